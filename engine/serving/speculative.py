"""Speculative decoding: a drafter proposes k tokens, the target model checks them in one forward pass.

A decode row that would compute one token computes ``1 + k``: its newest token and k draft tokens.
The target's logits at those positions say, token by token, whether each draft is what the target
would have produced; the first rejected draft and everything after it are taken back out of the
cache (``rollback``: the version advances, so any copy of the rejected K/V read later shows up as
stale), and the target's own token at that position is kept instead. Every step therefore yields
between 1 and k + 1 tokens per row for one forward pass, and the output is the target's:

- greedy: a draft is accepted while it equals the target's argmax, so the tokens are exactly those
  of plain greedy decoding;
- sampling: the standard rule (Leviathan et al., Chen et al.): draft ``x`` drawn from ``q`` is accepted
  with probability ``min(1, p(x) / q(x))``, and on rejection a token is drawn from ``max(0, p - q)``
  normalized, which leaves the target distribution ``p`` exactly as it is. A drafter that proposes
  deterministically (prompt lookup) has ``q`` a point mass on its token.

Two drafters: ``NgramDrafter`` (prompt lookup: the tokens that followed the latest earlier occurrence
of the sequence's last n-gram; no second model) and ``ModelDrafter`` (a smaller model sharing the
tokenizer, running on a paged cache of its own, kept in step with the accepted tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from ...events import SeqId
from ..model.sampling import SamplingParams, sample, sampling_probs

if TYPE_CHECKING:  # a drafter model's runner is handed in; the scheduler, which the runner uses, imports this module
    from .runner import Runner

__all__ = ["Draft", "Drafter", "NgramDrafter", "ModelDrafter", "verify", "DraftRequest"]


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (k, V) the distribution each token was drawn from; None: chosen outright


@dataclass
class DraftRequest:
    seq: SeqId
    tokens: list[int]  # the sequence so far (prompt and generated)
    k: int  # at most this many draft tokens
    sampling: SamplingParams
    generator: torch.Generator | None = None


class Drafter(Protocol):
    name: str

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Up to ``k`` draft tokens for each request (possibly none), in order."""
        ...

    def confirmed(self, seq: SeqId, length: int) -> None:
        """The first ``length`` tokens of ``seq`` are final (accepted or the target's own)."""
        ...

    def finished(self, seq: SeqId) -> None:
        ...

    def close(self) -> None:
        ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n`` tokens (``max_ngram``
    down to ``min_ngram``) and propose the tokens that followed it. Costs a scan of the sequence; helps
    where the output repeats its input (summaries, edits, code), proposes nothing where it does not."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(self._lookup(r.tokens, r.k)) for r in requests]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = tokens[L - n:]
            for start in range(L - n - 1, -1, -1):  # latest occurrence first, never the tail itself
                if tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []

    def confirmed(self, seq: SeqId, length: int) -> None:
        return None  # stateless

    def finished(self, seq: SeqId) -> None:
        return None

    def close(self) -> None:
        return None


class ModelDrafter:
    """A smaller model on a paged cache of its own proposes by decoding k tokens (greedily, or sampled
    under the request's own parameters, recording each distribution). Its cache keeps each sequence's
    confirmed tokens; proposals that were rejected are rolled back there too."""

    name = "model"

    def __init__(self, runner: Runner, target_vocab: int) -> None:
        vocab = runner.model.config.vocab_size
        if vocab != target_vocab:
            raise ValueError(f"the draft model's vocabulary has {vocab} tokens and the target's {target_vocab}: "
                             f"a draft model must share the target's tokenizer")
        self.runner = runner
        self.cache = runner.cache

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        cache = self.cache
        rows = []
        for r in requests:
            if r.seq not in cache.seqs:
                cache.add_sequence(r.seq, prompt_len=len(r.tokens))
            rows.append((r.seq, r.tokens[cache.seq_len(r.seq):] or r.tokens[-1:]))
        drafts = [Draft([], [] if not r.sampling.greedy else None) for r in requests]
        live = list(range(len(requests)))
        while live:
            logits = self.runner.forward([rows[i] for i in live])  # (B, V)
            cache.end_step()
            nxt = []
            for j, i in enumerate(live):
                r, d = requests[i], drafts[i]
                if r.sampling.greedy:
                    tok = int(logits[j].argmax())
                else:
                    q = sampling_probs(logits[j], r.sampling)
                    if q is None:
                        continue
                    tok = int(torch.multinomial(q, 1, generator=r.generator))
                    d.probs.append(q)
                d.tokens.append(tok)
                if len(d.tokens) < r.k:
                    rows[i] = (r.seq, [tok])
                    nxt.append(i)
            live = nxt
        for d in drafts:
            if isinstance(d.probs, list):
                d.probs = torch.stack(d.probs) if d.probs else None
        return drafts

    def confirmed(self, seq: SeqId, length: int) -> None:
        if seq in self.cache.seqs:
            extra = self.cache.seq_len(seq) - length
            if extra > 0:
                self.cache.rollback(seq, extra)

    def finished(self, seq: SeqId) -> None:
        if seq in self.cache.seqs:
            self.cache.remove_sequence(seq)

    def close(self) -> None:
        self.runner.close()


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator | None,
           argmax: list[int] | None = None) -> tuple[list[int], int]:
    """The tokens a row yields and how many drafts were accepted, from the target's ``logits`` (k + 1, V) at
    the row's newest token and its k drafts: the accepted drafts, then one token of the target's own.
    ``argmax``: the logits' argmax per position when the caller took it for many rows in one call (after a
    decode step has streamed the weights, each torch call costs ~0.1 ms: 0.9 ms a step at batch 8)."""
    k = len(draft.tokens)
    if params.greedy:
        target = argmax if argmax is not None else logits.argmax(dim=-1).tolist()  # (k + 1,)
        a = next((i for i in range(k) if draft.tokens[i] != target[i]), k)
        return draft.tokens[:a] + [target[a]], a
    for i, tok in enumerate(draft.tokens):
        p = sampling_probs(logits[i], params)
        if p is None:  # no token is possible at all (non-finite logits): keep going as plain sampling would
            return draft.tokens[:i] + [sample(logits[i], params, generator)], i
        q = draft.probs[i] if draft.probs is not None else None
        q_tok = float(q[tok]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if u * q_tok < float(p[tok]):  # accept with probability min(1, p/q)
            continue
        residual = (p - q).clamp_min_(0) if q is not None else p.clone().index_fill_(0, torch.tensor([tok]), 0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q: rejection has probability 0; a float edge case, keep p's own draw
            return draft.tokens[:i] + [int(torch.multinomial(p, 1, generator=generator))], i
        return draft.tokens[:i] + [int(torch.multinomial(residual / total, 1, generator=generator))], i
    return draft.tokens + [sample(logits[k], params, generator)], k
