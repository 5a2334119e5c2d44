"""Continuous batching: which sequences run each step, and which wait, swapped out, for room.

Requests arrive and leave at any step. Each step the scheduler ranks every live
request by priority (higher first), then arrival, and runs as many as fit the
device tier's blocks and the batch limits; a request it does not pick that still
holds device blocks is preempted when the picked ones need the room: its blocks
are swapped out to host (or disk when host is full), or, when no slower tier has
room, dropped and recomputed from its tokens later. A preempted request resumes,
its blocks swapped back in, as soon as it ranks among those that fit again.

Under storage failures it keeps serving: a preemption whose swap-out fails (a full disk) falls
back to dropping the K/V for recompute, and a request whose blocks a slower tier lost or cannot
give back (a spill file cut short, a corrupt copy) finishes as "error" with the engine's typed
error, as do the other requests owning the lost blocks; the rest of the step runs on.

Everything is recorded by the cache and runner: ``batch``, ``write``, ``read``,
``attn``, ``swap_out``/``swap_in``, ``rollback`` and the lifecycle events.

The scheduler plans by narrow questions to the cache, as vLLM's asks its KV cache manager: what the live
requests hold (``held``: length, blocks on the device, blocks away), once as it plans and once for the chosen
ones as it makes room, and each tier's room (``room``); it reaches into blocks only to preempt or recover.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from ...events import SeqId
from ..config import Tier
from ..errors import ChecksumMismatch, EngineError, StorageError
from ..kv.sequences import Held
from ..model.sampling import Generation, SamplingParams
from ..model.threads import torch_alone
from .speculative import Draft, Drafter, DraftRequest, verify

if TYPE_CHECKING:  # the runner hands itself to ``generate``: importing it at run time would close a cycle
    from .runner import Runner

__all__ = ["Request", "Scheduler", "StepResult", "generate"]


@dataclass
class Request:
    """One generation request. ``priority``: larger runs first and is preempted last."""

    prompt_ids: list[int]
    max_new_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # run to max_new_tokens even past the model's end-of-sequence token (benchmarks)
    adapter: str | None = None  # what it runs under besides the model (a LoRA's name): prefix-cache hits stay within it
    seq: SeqId | None = None  # the id in events; assigned by the scheduler when None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Request.prompt_ids: must hold at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens={self.max_new_tokens}: must be >= 1")


@dataclass
class _Live:
    request: Request
    seq: SeqId
    order: int  # arrival order, the tie-breaker after priority
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None
    state: str = "waiting"  # waiting (no KV yet), running (KV on device), swapped (KV away), dropped (recompute)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.generated

    @property
    def rank(self) -> tuple[int, int]:
        return (-self.request.priority, self.order)


@dataclass
class StepResult:
    """What one step did."""

    step: int
    rows: list[SeqId]
    num_tokens: int
    new_tokens: dict[SeqId, int]  # the newest token of each row that produced any (speculation may yield several)
    finished: list[Generation]
    preempted: list[SeqId]


def _row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: its first largest logit, a NaN counting as largest (as torch's ``argmax`` and ``max``).
    On CPU by numpy, which reads a batch-8 step's (8, 49152) float logits cold in 0.18 ms, against 0.26 for
    torch's ``max`` and 0.57 for its ``argmax``."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(axis=1).tolist()
    return logits.max(dim=-1).indices.tolist()


class Scheduler:
    """Continuous batching over one ``Runner``.

    ``max_batch``: rows per step. ``max_step_tokens``: tokens per step; a longer prompt is
    prefilled in chunks. ``keep_logits`` keeps each generated token's fp32 logits (tests).
    ``on_token(seq, token)`` is called for every generated token (streaming).
    ``drafter``: speculative decoding (``engine.serving.speculative``): each decode row also computes up to
    ``num_draft`` draft tokens, verified in the same forward pass; rejected ones are rolled back.
    """

    def __init__(self, runner: Runner, *, max_batch: int = 8, max_step_tokens: int = 2048,
                 keep_logits: bool = False, on_token: Callable[[SeqId, int], None] | None = None,
                 drafter: Drafter | None = None, num_draft: int = 4) -> None:
        if max_batch < 1 or max_step_tokens < 1:
            raise ValueError(f"max_batch={max_batch}, max_step_tokens={max_step_tokens}: both must be >= 1")
        if num_draft < 1:
            raise ValueError(f"num_draft={num_draft}: must be >= 1")
        self.drafter = drafter
        self.num_draft = num_draft
        self.num_forwards = 0  # rows of target forward passes that yielded tokens (a sequence's decode passes)
        self.num_generated = 0
        self.num_drafted = 0  # draft tokens proposed, and accepted
        self.num_accepted = 0
        self.runner = runner
        self.cache = runner.cache
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.keep_logits = keep_logits
        self.on_token = on_token
        self.live: dict[SeqId, _Live] = {}
        self.done: dict[SeqId, Generation] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._eos = frozenset(runner.eos_token_ids)
        self.capacity = self.cache.config.capacity(Tier.DEVICE)
        # long context: a sequence may hold blocks in every tier, and a step may take fewer of a prompt's tokens
        self.total_capacity = sum(self.cache.config.capacity(t) for t in self.cache.config.tiers)
        self._long_context = self.cache.staging is not None

    # ---- requests in and out ----
    def submit(self, request: Request) -> SeqId:
        """Queue a request; it is admitted at the next step that has room. Returns its sequence id."""
        seq = request.seq
        if seq is None:
            seq = next(self._ids)
            while seq in self.live or seq in self.done or self.cache.has_sequence(seq):
                seq = next(self._ids)
        elif seq in self.live or seq in self.done or self.cache.has_sequence(seq):
            raise ValueError(f"sequence id {seq!r} is already in use")
        live = _Live(request, seq, next(self._order))
        if not request.sampling.greedy:
            live.generator = torch.Generator(device="cpu")
            live.generator.manual_seed(request.sampling.seed if request.sampling.seed is not None else hash(seq) & 0xFFFF_FFFF)
        self.live[seq] = live
        return seq

    def abort(self, seq: SeqId) -> Generation:
        """Stop a request now; its blocks are released and it finishes as "aborted"."""
        return self._finish(self._live(seq), "aborted")

    def rollback(self, seq: SeqId, n: int) -> None:
        """Discard the last ``n`` generated tokens (rejected speculation); decoding resumes before them."""
        live = self._live(seq)
        if not 1 <= n <= len(live.generated):
            raise ValueError(f"rollback of {n} tokens for {seq!r}: must be in [1, {len(live.generated)}] (generated)")
        if live.state in ("running", "swapped"):
            # The newest generated token has not been fed back yet, so the cache holds one token
            # fewer than prompt + generated and drops exactly n.
            self.cache.rollback(seq, n)
        del live.generated[-n:]
        if self.drafter is not None:
            self.drafter.confirmed(seq, len(live.tokens) - 1)
        del live.logits[len(live.generated):]

    def state(self, seq: SeqId) -> str:
        """``waiting`` (no KV yet), ``running``, ``swapped`` (KV on a slower tier) or ``dropped`` (to recompute)."""
        return self._live(seq).state

    def has_work(self) -> bool:
        return bool(self.live)

    def run(self, max_steps: int | None = None) -> dict[SeqId, Generation]:
        """Step until every request has finished (or ``max_steps``); returns all finished requests."""
        steps = 0
        while self.live and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return self.done

    # ---- one step ----
    def step(self) -> StepResult:
        cache = self.cache
        step = cache.bus.step
        chosen, preempt = self._plan(cache.held(self.live))
        held = cache.held(lv.seq for lv in chosen)  # (a request _plan aborted gave its blocks up meanwhile)
        preempted = self._make_room(chosen, preempt, held)
        chosen = self._resume(chosen)
        rows, ends = [], []
        budget = self.max_step_tokens
        for live in chosen:
            done = held[live.seq].length if live.seq in held else 0  # preemption and resuming keep the chosen's lengths
            if live.state == "waiting":
                self.runner.weights_watch.check()  # weights edited since the last step: salted anew before admission
                cache.add_sequence(live.seq, prompt_len=len(live.request.prompt_ids), priority=live.request.priority,
                                   adapter=live.request.adapter)
            if live.state in ("waiting", "dropped") and not done:
                done = cache.reuse_prefix(live.seq, live.tokens)  # with a prefix cache: compute only what is not cached
            live.state = "running"
            # (a cache holding more than the request's tokens, as after a rollback the spec-rollback-uncut
            # fault did not cut, is still given the newest token)
            todo = live.tokens[done:] or live.tokens[-1:]
            take = todo[: max(1, min(len(todo), budget))] if len(todo) > 1 else todo
            if self._long_context:  # a prompt longer than the device goes in chunks
                take = take[: cache.max_step_tokens(live.seq)]
            budget -= len(take)
            rows.append((live.seq, take))
            ends.append(len(take) == len(todo))  # the row reaches the end of its tokens: sample after it
        drafts = self._draft(chosen, rows, ends, budget)
        rows = [(seq, take + d.tokens) if d is not None else (seq, take) for (seq, take), d in zip(rows, drafts)]
        new_tokens: dict[SeqId, int] = {}
        finished: list[Generation] = []
        if rows:
            tails = [1 + len(d.tokens) if d is not None else 1 for d in drafts]
            logits = self.runner.forward(rows, tail_logits=tails)  # (sum of tails, V)
            self.num_forwards += sum(ends)
            greedy = _row_argmax(logits) if any(live.request.sampling.greedy for live in chosen) else None
            offset = 0
            for live, end, d, m in zip(chosen, ends, drafts, tails):
                row_logits, row_argmax = logits[offset:offset + m], greedy[offset:offset + m] if greedy else None
                offset += m
                if end:
                    with torch_alone():  # a token's sampling: too small for torch's team (threads.py)
                        toks = self._accept(live, row_logits, d, row_argmax)
                    done = self._emit(live, toks, row_logits, new_tokens)
                    if done is not None:
                        finished.append(done)
        self._prefetch_next(chosen)
        num_tokens = sum(len(t) for _, t in rows)
        cache.end_step(num_tokens)
        return StepResult(step, [s for s, _ in rows], num_tokens, new_tokens, finished, preempted)

    # ---- speculative decoding ----
    def _draft(self, chosen: list[_Live], rows: list[tuple[SeqId, list[int]]], ends: list[bool], budget: int
               ) -> list[Draft | None]:
        """Draft tokens for each decode row (None for other rows), within the step's token budget and
        each request's remaining tokens (the verified step yields up to one more than it drafts)."""
        out: list[Draft | None] = [None] * len(rows)
        if self.drafter is None:
            return out
        want: list[tuple[int, DraftRequest]] = []
        for i, (live, (_, take), end) in enumerate(zip(chosen, rows, ends)):
            k = min(self.num_draft, live.request.max_new_tokens - len(live.generated) - 1, budget)
            if end and len(take) == 1 and live.generated and k > 0:
                want.append((i, DraftRequest(live.seq, live.tokens, k, live.request.sampling, live.generator)))
                budget -= k
        if want:
            for (i, _), d in zip(want, self.drafter.propose([r for _, r in want])):
                if d.tokens:
                    out[i] = d
                    self.num_drafted += len(d.tokens)
        return out

    def _accept(self, live: _Live, logits: torch.Tensor, draft: Draft | None, argmax: list[int] | None
                ) -> list[int]:
        """The tokens a row yields: its drafts the target accepts and one of the target's own; the rejected
        drafts are rolled back out of the cache."""
        params = live.request.sampling
        if draft is None:
            toks, _ = verify(logits, Draft([]), params, live.generator, argmax)
            return toks
        before = len(live.tokens)
        toks, accepted = verify(logits, draft, params, live.generator, argmax)
        self.num_accepted += accepted
        rejected = len(draft.tokens) - accepted
        if rejected:
            self.cache.rollback(live.seq, rejected)  # the version advances: the rejected K/V reads as stale
        self.drafter.confirmed(live.seq, before + accepted)
        return toks

    def _emit(self, live: _Live, toks: list[int], logits: torch.Tensor, new_tokens: dict[SeqId, int]
              ) -> Generation | None:
        """Append a row's new tokens, stopping at a stop token or the length limit; the finished request, if any."""
        for j, tok in enumerate(toks):
            live.generated.append(tok)
            self.num_generated += 1
            if self.keep_logits:
                live.logits.append(logits[j].clone())
            new_tokens[live.seq] = tok
            if self.on_token is not None:
                self.on_token(live.seq, tok)
            if (tok in self._eos and not live.request.ignore_eos) or tok in live.request.stop_token_ids:
                return self._finish(live, "stop")
            if len(live.generated) >= live.request.max_new_tokens:
                return self._finish(live, "length")
        return None

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding's figures: acceptance rate, and tokens a sequence got per target forward pass
        that computed it (1 without speculation)."""
        return {
            "drafted": self.num_drafted, "accepted": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "target_forwards": self.num_forwards,
            "tokens_per_forward": self.num_generated / self.num_forwards if self.num_forwards else 0.0,
        }

    def _plan(self, held: dict[SeqId, Held]) -> tuple[list[_Live], list[_Live]]:
        """The requests to run this step (best rank first, as many as fit) and the resident ones left out, by what
        each ``held`` at the step's start."""
        chosen: list[_Live] = []
        left: list[_Live] = []
        room = self.capacity
        tokens = self.max_step_tokens
        for live in sorted(self.live.values(), key=lambda lv: lv.rank):
            need = self._blocks_after_step(live, held)
            whole = -(-len(live.tokens) // self.cache.block_size)
            if whole > (self.total_capacity if self._long_context else self.capacity):
                # Longer than the whole device tier (every tier, with long context): it can never run.
                self._finish(live, "aborted")
                continue
            todo = len(live.tokens) - (held[live.seq].length if live.seq in held else 0)
            fits = need <= room and len(chosen) < self.max_batch and (tokens > 0 or todo <= 1)
            if fits:
                chosen.append(live)
                room -= need
                tokens -= todo
            elif live.state == "running":
                left.append(live)
        return chosen, left

    def _resume(self, chosen: list[_Live]) -> list[_Live]:
        """Bring the chosen requests' blocks back to the device one request at a time, before the forward
        pass, so a slower tier that lets one down fails only the requests whose blocks it lost (and the
        one it could not bring back); returns those still to run. (Long context reads blocks where they
        are, through staging: there a failure still reaches the caller of ``step``.)
        What each holds is asked once preemption is over (it may have taken a shared block away), and a request
        again at its turn once another's blocks were brought back (that may have moved its own)."""
        if self._long_context:
            return chosen
        held = self.cache.held(lv.seq for lv in chosen)
        moved = False
        for live in chosen:
            h = (self.cache.held([live.seq]) if moved else held).get(live.seq)
            if live.seq in self.live and h is not None and h.away:
                moved = True
                try:
                    self.cache.ensure_resident([live.seq])
                except (StorageError, ChecksumMismatch) as exc:
                    self._fail(live, exc)
        return [lv for lv in chosen if lv.seq in self.live]

    def _fail(self, live: _Live, exc: StorageError | ChecksumMismatch) -> None:
        """Finish ``live``, and every request owning a block ``exc`` says was lost, as "error" with ``exc``."""
        lost = exc.blocks if isinstance(exc, StorageError) else (exc.block,)
        owners = {o for b in lost if (blk := self.cache.block(b)) is not None for o in blk.owners}
        for lv in [live] + [lv for lv in self.live.values() if lv.seq in owners and lv is not live]:
            self._finish(lv, "error", exc)

    def _prefetch_next(self, chosen: list[_Live]) -> None:
        """Start bringing the next request to resume, when it is a swapped-out one, back up in the
        background: up to ``prefetch_depth`` blocks per step, into device room that the requests
        running now will not need at their next token, never demoting anything for it. Its
        ``ensure_resident`` then finds them there (prefetch hits) instead of copying while the step waits."""
        running = [lv for lv in chosen if lv.seq in self.live]
        ids = {lv.seq for lv in chosen}
        rest = [lv for lv in self.live.values() if lv.seq not in ids]
        if not rest:
            return
        nxt = min(rest, key=lambda lv: lv.rank)
        if nxt.state != "swapped":
            return
        held = self.cache.held(lv.seq for lv in running)
        growth = sum(max(self._blocks_after_step(lv, held) - self._device_blocks(lv.seq, held), 0) for lv in running)
        room = self.cache.free_blocks(Tier.DEVICE) - growth
        if room > 0:
            self.cache.prefetch(nxt.seq, max_blocks=room)

    def _blocks_after_step(self, live: _Live, held: dict[SeqId, Held]) -> int:
        """Device blocks ``live`` holds once this step's tokens are in (a generous bound for chunked prefill),
        draft tokens included, by what it ``held`` before. Long context: at most the device, which streams the rest
        (``_plan`` checks the total against every tier)."""
        drafts = self.num_draft if self.drafter is not None else 0
        h = held.get(live.seq)
        tokens = h.length + 1 if h is not None else 0  # more than its tokens only after a rollback left uncut
        blocks = -(-(max(len(live.tokens), tokens) + drafts) // self.cache.block_size)
        if self._long_context:
            return min(blocks, self.capacity)
        return blocks

    @staticmethod
    def _device_blocks(seq: SeqId, held: dict[SeqId, Held]) -> int:
        """Device blocks ``seq`` ``held``, counting those a prefetch is bringing up (their slots are taken)."""
        h = held.get(seq)
        return h.on_device if h is not None else 0

    def _reclaimable(self, chosen: list[_Live]) -> int:
        """Device blocks that prefetches brought up for requests not running this step: their copies
        are landed (waited for if still in flight) so the cache can demote them again for the room."""
        ids = {lv.seq for lv in chosen}
        n = 0
        for lv in self.live.values():
            if lv.state != "swapped" or lv.seq in ids or not self.cache.has_sequence(lv.seq):
                continue
            for b in self.cache.blocks_of(lv.seq):
                if not self.cache.settle(b):
                    continue  # the bad copy was discarded; the block stays away, its slot is free again
                n += b.tier == Tier.DEVICE
        return n

    def _make_room(self, chosen: list[_Live], left: list[_Live], held: dict[SeqId, Held]) -> list[SeqId]:
        """Preempt the lowest-ranked resident requests left out until the chosen ones fit, by what the chosen
        ``held``."""
        room = self.cache.room()  # a prefix cache's blocks that no request holds make room when asked
        free = room[Tier.DEVICE]
        need = sum(self._blocks_after_step(lv, held) - self._device_blocks(lv.seq, held) for lv in chosen)
        if need > free:
            settled = self._reclaimable(chosen)
            room = self.cache.room()  # settling prefetches gave slots back, maybe on the slower tiers too
            free = settled + room[Tier.DEVICE]
        preempted = []
        for live in sorted(left, key=lambda lv: lv.rank, reverse=True):
            if need <= free:
                break
            free += self._preempt(live, room)
            preempted.append(live.seq)
        return preempted

    def _preempt(self, live: _Live, room: dict[str, int]) -> int:
        """Move ``live``'s blocks off the device: swap to host, else disk (where ``room`` has space for them; it is
        taken from it), else drop for recompute."""
        # (a block the prefix-freed-in-use fault dropped under the request is no longer the pool's to move)
        on_device = [b.id for b in self.cache.blocks_of(live.seq) if b.tier == Tier.DEVICE and self.cache.block(b.id) is b]
        for dst in (Tier.HOST, Tier.DISK):
            if room.get(dst, -1) >= len(on_device):
                try:
                    self.cache.swap_out(on_device, dst=dst)
                except StorageError:
                    continue  # nothing moved (a full disk, recorded as io_error): try the next way
                room[dst] -= len(on_device)
                live.state = "swapped"
                return len(on_device)
        # Nowhere to keep the K/V: drop it and recompute from the tokens when the request resumes.
        if self.cache.seq_len(live.seq):
            self.cache.rollback(live.seq, self.cache.seq_len(live.seq))
        live.state = "dropped"
        return len(on_device)

    def _live(self, seq: SeqId) -> _Live:
        try:
            return self.live[seq]
        except KeyError:
            raise KeyError(f"no live request with sequence id {seq!r}") from None

    def _finish(self, live: _Live, reason: str, error: EngineError | None = None) -> Generation:
        del self.live[live.seq]
        if self.drafter is not None:
            self.drafter.finished(live.seq)
        if self.cache.has_sequence(live.seq):
            self.cache.remove_sequence(live.seq, reason="aborted" if reason in ("aborted", "error") else "finished",
                                       error=type(error).__name__ if error is not None else None)
        gen = Generation(live.seq, list(live.request.prompt_ids), list(live.generated), reason,
                         logits=live.logits, error=error)
        if self.runner.tokenizer is not None:
            gen.text = self.runner.decode(live.generated)
        self.done[live.seq] = gen
        return gen


def generate(runner: Runner, prompts: Iterable[str | Sequence[int]], *, max_new_tokens: int = 32,
             sampling: SamplingParams | None = None, chat: bool = False, stop_token_ids: Iterable[int] = (),
             keep_logits: bool = False, max_batch: int = 8) -> list[Generation]:
    """Run every prompt (text, or token ids) to completion on ``runner`` with continuous batching; results in
    prompt order (``Runner.generate``)."""
    sched = Scheduler(runner, max_batch=max_batch, keep_logits=keep_logits)
    seqs = []
    for prompt in prompts:
        ids = runner.encode(prompt, chat=chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        seqs.append(sched.submit(Request(ids, max_new_tokens=max_new_tokens, sampling=sampling or SamplingParams(),
                                         stop_token_ids=tuple(stop_token_ids))))
    done = sched.run()
    return [done[s] for s in seqs]
