"""Attention over K/V gathered from the engine's blocks, with statistics taken from the scores it computes.

Grouped-query attention runs on the key/value heads without repeating K and V:
the ``H`` query heads are folded into ``H_kv`` groups of ``H / H_kv``. Rows of a
batch may have different query and key lengths; ``AttnLayout`` holds the padding
mask once per step so every layer reuses it, for a ``Group`` of rows attended together.

When statistics are due, attention is computed explicitly (scores, softmax,
weighted sum) and the scaled scores of each row's newest query are handed back;
``attention_stats`` turns the scores of every layer of a step into statistics in
one vectorized pass: the largest scaled logit, the mean over heads of the Shannon
entropy in nats, the probability mass on the sequence's first block (attention
sinks), and the number of non-finite scores or probabilities. ``layer_stats`` takes the
same statistics from each layer's scores as they are, without stacking them, on CPU in
two compiled vector passes per head (``attn_stats.c``, built by ``native``), in decode from
the probabilities attention computed, with no exponential, a fraction of what the dozen torch
passes they stand in for cost (those run where no compiler is). When they are not
due, prefill takes PyTorch's fused ``scaled_dot_product_attention``; decode (one
query per row) is explicit either way, as fast as the fused kernel at that size, so
a step with statistics attends no slower than one without.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import native, pool
from ..kv.readplan import BlockTable

__all__ = ["AttnLayout", "AttnStats", "Group", "Newest", "attend", "attention_stats", "layer_stats", "hidden_keys",
           "STAT_FIELDS"]

STAT_FIELDS = ("max_logit", "entropy", "sink", "nonfinite")
_EXP_FLOOR = -80.0  # exp() of anything lower is treated as exp(-80): see _finite_stats


@dataclass(frozen=True)
class AttnLayout:
    """Where the valid queries and keys of a padded batch are; built once per step.

    Row ``b`` has ``q_lens[b]`` queries at positions ``kv_lens[b] - q_lens[b]`` … ``kv_lens[b] - 1``
    and ``kv_lens[b]`` keys at positions ``0`` … ``kv_lens[b] - 1``; each query sees the keys
    at or before its own position, and with a ``window`` only the newest ``window`` of them
    (sliding-window attention: a query at ``p`` sees ``p - window + 1 … p``).
    """

    allowed: torch.Tensor | None  # (B, 1, S, T) bool, or None when no row needs masking
    last_query: torch.Tensor  # (B,) index of each row's newest query within S
    keep: torch.Tensor | None  # (B, T) bool: the keys each row's newest query sees; None: all
    sink_tokens: int
    causal: bool  # no mask, and the queries are the whole fresh sequence: query i sees keys 0 … i
    uniform_last: bool  # every row's newest query is the last of S

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """``allowed`` as an additive float32 mask (B, 1, S, T): 0 where a key is seen, the lowest finite
        value where not (so a row with no key left averages V rather than turning NaN). Built on first
        use, then shared by every layer of the step."""
        if self.allowed is None:
            return None
        low = torch.finfo(torch.float32).min
        return torch.zeros(self.allowed.shape, device=self.allowed.device).masked_fill_(~self.allowed, low)

    @classmethod
    def build(
        cls, q_lens: list[int], kv_lens: list[int], *, sink_tokens: int, device: torch.device | str = "cpu",
        window: int | None = None,
    ) -> AttnLayout:
        if len(q_lens) != len(kv_lens) or not q_lens:
            raise ValueError(f"q_lens {q_lens} and kv_lens {kv_lens} must be non-empty and of equal length")
        if any(q < 1 or q > t for q, t in zip(q_lens, kv_lens)):
            raise ValueError(f"every row needs 1 <= q_len <= kv_len, got q_lens {q_lens} kv_lens {kv_lens}")
        S, T = max(q_lens), max(kv_lens)
        uniform = len(set(q_lens)) == 1 and len(set(kv_lens)) == 1
        allowed = None
        windowed = window is not None and T > window  # a window shorter than the keys hides some of them
        # One query per row over equal lengths, or a fresh causal prefill, needs no explicit mask.
        if windowed or not (uniform and (S == 1 or S == T)):
            q_idx = torch.arange(S, device=device)
            k_idx = torch.arange(T, device=device)
            q_len = torch.tensor(q_lens, device=device)
            kv_len = torch.tensor(kv_lens, device=device)
            q_pos = (kv_len - q_len)[:, None] + q_idx[None, :]  # (B, S) absolute position of each query
            allowed = (k_idx[None, None, :] <= q_pos[:, :, None]) & (k_idx[None, None, :] < kv_len[:, None, None])
            if windowed:
                allowed &= k_idx[None, None, :] > q_pos[:, :, None] - window
            allowed &= (q_idx[None, :] < q_len[:, None])[:, :, None]
            # A padded query row sees key 0 only, so its softmax stays finite (its output is discarded).
            allowed[:, :, 0] |= ~(q_idx[None, :] < q_len[:, None])
            allowed = allowed[:, None]  # (B, 1, S, T)
        last = torch.tensor([q - 1 for q in q_lens], device=device)
        keep = None
        if len(set(kv_lens)) > 1 or windowed:
            k_idx = torch.arange(T, device=device)[None, :]
            kv_len = torch.tensor(kv_lens, device=device)[:, None]
            keep = k_idx < kv_len
            if windowed:
                keep &= k_idx > kv_len - 1 - window
        return cls(allowed, last, keep, sink_tokens, allowed is None and S > 1, len(set(q_lens)) == 1)

    @classmethod
    def from_mask(cls, allowed: torch.Tensor | None, batch: int, q_len: int, *, sink_tokens: int) -> AttnLayout:
        """The layout of a batch whose mask someone else built (transformers' boolean SDPA mask, or None).

        Every row's newest query is the last one, as in transformers' left-padded batches.
        """
        last = torch.full((batch,), q_len - 1, dtype=torch.long)
        keep = None
        if allowed is not None:
            allowed = allowed.expand(batch, 1, *allowed.shape[-2:])
            last = last.to(allowed.device)
            keep = allowed[:, 0, -1]  # (B, T)
        return cls(allowed, last, keep, sink_tokens, allowed is None and q_len > 1, True)


@dataclass
class Group:
    """Rows attended together (the runner's step features see them too): all one-token decode rows, or one
    multi-token row."""

    rows: list[int]  # indices into the step's rows
    seqs: list[Any]  # their sequences
    tokens: slice | torch.Tensor  # which flat tokens belong to the group, in row order
    q_len: int
    lens: list[int]  # keys of each row
    sink_tokens: int
    blocks: BlockTable  # the rows' device block table from the step's read plan, and where their K/V rows start
    kv_len: int  # keys of the longest row
    key_bias: torch.Tensor | None = None  # (L, B, H_kv, T) token merging's score bias of each key (engine.kv.merge)

    @cached_property
    def layout(self) -> AttnLayout:
        """The rows' padding and causal mask, built by the paths that use it: the compiled decode layers take
        each row's length instead (a layout costs 0.14 ms at batch 8, built after a step's weights stream)."""
        return AttnLayout.build([self.q_len] * len(self.rows), self.lens, sink_tokens=self.sink_tokens,
                                device=self.blocks.slots.device)


@dataclass(frozen=True)
class AttnStats:
    """Statistics of every layer and row of one step, still as tensors: they leave for Python once per step."""

    summary: torch.Tensor  # (L, B, 4) float32: max_logit, entropy, sink, nonfinite
    heads_entropy: torch.Tensor | None = None  # (L, B, H)
    heads_max_logit: torch.Tensor | None = None  # (L, B, H)
    host: np.ndarray | None = None  # the summary's memory as numpy sees it, when it lives on the host
    counts: np.ndarray | None = None  # (L, B) int64: the non-finite counts as integers, where a kernel wrote them

    def fields(self) -> dict[str, Any]:
        """The statistics as an ``attn_step`` event's fields (grids layer by row), besides ``seqs``: one
        transfer each of the float statistics and of the counts (regrouping them in Python costs more), by
        numpy (after a decode step has streamed the weights through the caches, torch's slicing and
        transfers of a batch-8 summary cost 0.17 ms, numpy's 0.09; the counts the compiled layers write as
        integers save numpy's conversion, 0.02 ms)."""
        grids = (self.host if self.host is not None else self.summary.cpu().numpy()).transpose(2, 0, 1)
        max_logit, entropy, sink = grids[:3].tolist()
        counts = self.counts if self.counts is not None else grids[3].astype(np.int64)
        return {"max_logit": max_logit, "entropy": entropy, "sink": sink, "nonfinite": counts.tolist(),
                "heads_entropy": None if self.heads_entropy is None else self.heads_entropy.tolist(),
                "heads_max_logit": None if self.heads_max_logit is None else self.heads_max_logit.tolist()}


class Newest(NamedTuple):
    """What statistics need of each row's newest query in one layer: its scaled pre-softmax scores
    (B, H, T) and, in decode, the float32 probabilities attention took of them (None elsewhere); or the
    same of every layer at once, (L, B, H, T) each (the compiled decode layers' buffer)."""

    scores: torch.Tensor
    probs: torch.Tensor | None = None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttnLayout,
    *,
    scale: float,
    scores: bool = False,
    corrupt: Callable[[torch.Tensor], torch.Tensor] | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Newest | None]:
    """Attention of ``q`` (B, H, S, D) over ``k``, ``v`` (B, H_kv, T, D); returns (B, H, S, D) and the scores.

    With ``scores`` the scaled pre-softmax scores of each row's newest query come back as
    (B, H, T) for ``layer_stats``, with their probabilities in decode. Decode (``S == 1``) is always
    computed explicitly: at one query per row two matmuls are as fast as the fused kernel, so
    statistics cost nothing extra there. Longer queries use the fused SDPA kernel unless scores or
    ``corrupt`` need the explicit path. ``corrupt`` sees the scaled scores ``(B, H, S, T)`` before the
    softmax (the attention-nan fault's hook). ``key_bias`` (B, H_kv, T) is added to every query's scaled
    score of each key (token merging: ``log(count)`` of a merged slot, a large negative number for a dead
    one; see ``engine.kv.merge``); the scores handed back include it, so statistics describe the distribution
    attention used.
    """
    B, H, S, D = q.shape
    H_kv, T = k.shape[1], k.shape[2]
    if H % H_kv:
        raise ValueError(f"{H} query heads are not a multiple of {H_kv} key/value heads")
    g = H // H_kv
    if S == 1 and corrupt is None:
        # One query per row (decode): two small matmuls cost no more than the fused kernel at this size,
        # and the scores statistics need are already there, so a statistics step attends no slower.
        raw = torch.matmul(q.reshape(B, H_kv, g, D), k.transpose(-1, -2)).mul_(scale)  # (B, H_kv, g, T)
        if key_bias is not None:
            raw += key_bias[:, :, None].to(raw.dtype)
        masked = raw if layout.bias is None else raw + layout.bias.to(raw.dtype)  # bias (B, 1, 1, T)
        probs = torch.softmax(masked, dim=-1, dtype=torch.float32).to(q.dtype)
        newest = Newest(raw.view(B, H, T), probs.view(B, H, T)) if scores else None
        return torch.matmul(probs, v).view(B, H, 1, D), newest
    if not scores and corrupt is None and key_bias is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=layout.allowed, scale=scale, is_causal=layout.causal, enable_gqa=H != H_kv
        )
        return out, None
    qg = q.reshape(B, H_kv, g * S, D)  # query head h uses kv head h // g, as repeat_kv lays them out
    raw = (qg @ k.transpose(-1, -2)).mul_(scale)  # (B, H_kv, g*S, T)
    if key_bias is not None:
        raw += key_bias[:, :, None].to(raw.dtype)
    if corrupt is not None:
        raw = corrupt(raw.view(B, H, S, T)).view(B, H_kv, g * S, T)
    newest = None
    if scores:
        full = raw.view(B, H, S, T)
        if S == 1:
            newest = full[:, :, 0]  # a view: the masking below does not write into ``raw``
        elif layout.uniform_last:
            newest = full[:, :, -1].clone()  # a copy, so the (S, T) scores of a prefill are not kept alive
        else:
            newest = full[torch.arange(B, device=q.device), :, layout.last_query]
    # The most negative finite value rather than -inf: a query row with every key masked (left
    # padding in transformers' batches) then averages V instead of turning the row into NaN.
    low = torch.finfo(raw.dtype).min
    if layout.allowed is not None:
        raw = raw.view(B, H_kv, g, S, T).masked_fill(~layout.allowed[:, :, None], low)
    elif layout.causal:
        raw = raw.view(B, H_kv, g, S, T).masked_fill(
            torch.ones(S, T, dtype=torch.bool, device=q.device).triu_(T - S + 1), low
        )
    probs = torch.softmax(raw, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs.view(B, H_kv, g * S, T) @ v).view(B, H, S, D), None if newest is None else Newest(newest)


def attention_stats(scores: torch.Tensor, keep: torch.Tensor | None, *, sink_tokens: int,
                    per_head: bool = False) -> AttnStats:
    """Statistics of the newest query of each row from its scaled pre-softmax scores ``(L, B, H, T)``.

    ``keep`` (B, T), or (L, B, T) when layers differ (sliding-window layers), marks the keys that
    query may see (None: all). Non-finite scores are
    counted, along with every probability of a head whose softmax they break (NaN or +inf);
    the other statistics are taken over the finite scores, so they stay numbers a trace can hold.
    """
    L, B, H, T = scores.shape
    hidden = hidden_keys(keep)
    # The common case first: a visible score that is not finite turns its head's statistics into NaN
    # or inf there (see _finite_stats), so one check of the small result replaces a pass over the scores.
    stats = _finite_stats(scores, hidden, sink_tokens, per_head)
    if stats is not None and bool(torch.isfinite(stats.summary).all()):
        return stats
    keep4 = torch.ones(1, B, 1, T, dtype=torch.bool, device=scores.device) if hidden is None else ~hidden
    finite = torch.isfinite(scores)
    bad = ~finite & keep4
    breaks = (torch.isnan(scores) | (scores == float("inf"))) & keep4
    valid_len = keep4.sum(-1)  # (1, B, 1)
    nonfinite = bad.sum(dim=(-1, -2)) + (breaks.any(-1) * valid_len).sum(-1)  # (L, B)
    usable = finite & keep4
    masked = scores.masked_fill(~usable, float("-inf"))
    heads_max = masked.amax(dim=-1)  # (L, B, H)
    probs = torch.softmax(masked, dim=-1).nan_to_num_(0.0)  # a head with no finite score has no distribution
    heads_entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # (L, B, H)
    sink = probs[..., :sink_tokens].sum(dim=-1).mean(dim=-1)  # (L, B)
    heads_max = torch.where(torch.isfinite(heads_max), heads_max, torch.zeros_like(heads_max))
    summary = torch.stack([heads_max.amax(dim=-1), heads_entropy.mean(dim=-1), sink, nonfinite.float()], dim=-1)
    return AttnStats(summary, heads_entropy, heads_max) if per_head else AttnStats(summary)


def layer_stats(per_layer: Sequence[Newest], keep: torch.Tensor | None, *, sink_tokens: int,
                per_head: bool = False) -> AttnStats:
    """``attention_stats`` of each layer's newest-query scores ``(B, H, T)``: by the compiled pass for
    float32 scores on CPU (from the probabilities too where attention kept them, which spares it every
    exponential), by torch's passes over the scores stacked elsewhere (or where no compiler built it)."""
    kernel = _stats_kernel()
    first = per_layer[0].scores
    if kernel is None or first.device.type != "cpu" or first.dtype != torch.float32:
        return attention_stats(torch.stack([n.scores for n in per_layer]), keep, sink_tokens=sink_tokens,
                               per_head=per_head)
    L, (B, H, T) = len(per_layer), first.shape
    scores = [n.scores.contiguous() for n in per_layer]
    probs = [n.probs.contiguous() for n in per_layer] \
        if all(n.probs is not None and n.probs.dtype == torch.float32 for n in per_layer) else None
    if any(t.shape != first.shape for t in (*scores, *(probs or ()))):  # the kernel reads (B, H, T) of each
        raise ValueError(f"every layer's scores and probabilities must be {tuple(first.shape)}")
    mask = _key_lanes(keep, L, B, T)
    summary = torch.empty(L, B, 4)
    heads = (torch.empty(L, B, H), torch.empty(L, B, H)) if per_head else (None, None)
    kernel(_pointers(scores), None if probs is None else _pointers(probs), None if mask is None else mask.data_ptr(),
           B * T if mask is not None and mask.dim() == 3 else 0, L, B, H, T, sink_tokens, summary.data_ptr(),
           *(None if t is None else t.data_ptr() for t in heads), pool.team())
    return AttnStats(summary, *heads) if per_head else AttnStats(summary)


def _key_lanes(keep: torch.Tensor | None, L: int, B: int, T: int) -> torch.Tensor | None:
    """``keep`` as the kernel reads it: an int32 lane per key, (B, T) for every layer or (L, B, T) per layer,
    contiguous (a (1, B, T) mask spreads over the layers; a shape that does not fit raises, as a broadcast would)."""
    if keep is None:
        return None
    lanes = keep.to(torch.int32)
    return (lanes.expand(L, B, T) if keep.dim() == 3 else lanes.expand(B, T)).contiguous()


def _pointers(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


@functools.cache
def _stats_kernel() -> Callable[..., None] | None:
    c = ctypes
    return native.function(native.source("attn_stats.c"), "kvdoctor_attn_stats",
                           (c.c_void_p,) * 3 + (c.c_int64,) * 6 + (c.c_void_p,) * 3 + (c.c_int,))


def hidden_keys(keep: torch.Tensor | None) -> torch.Tensor | None:
    """The keys a newest query does not see, (1 or L, B, 1, T) for scores (L, B, H, T): padding past a
    row's keys, and keys behind a sliding window, from ``keep`` (B, T) or per layer (L, B, T)."""
    if keep is None:
        return None
    return ~(keep if keep.dim() == 3 else keep[None])[:, :, None, :]


def _finite_stats(scores: torch.Tensor, hidden: torch.Tensor | None, sink_tokens: int, per_head: bool
                  ) -> AttnStats | None:
    """The common case, every visible score finite: entropy as ``log Z - E[s - m]``, one exponential pass.

    ``s - m`` is clamped at ``_EXP_FLOOR`` before the exponential: torch's CPU ``exp`` takes a slow path,
    about 40x, for every input whose result underflows, and hidden keys (padding, keys behind a window)
    would all take it; ``exp(-80)`` is 1.8e-35 of the largest term, below any statistic's precision. A
    visible NaN or +inf makes ``m`` or ``s - m`` NaN, which shows in the result; a visible -inf, which the
    clamp would hide, returns None: the caller then counts non-finite scores exactly.

    Two (L, B, H, T) buffers in all, ``d`` and ``e``, each written in place after it is made: a fresh
    buffer of that size costs as much as the arithmetic on it (page faults)."""
    if bool(scores.amin() == float("-inf")):  # one reduction in the usual case; the exact test only when needed
        neg_inf = torch.isneginf(scores)
        if bool((neg_inf if hidden is None else neg_inf & ~hidden).any()):
            return None
    if hidden is None:
        d = scores.clone()
    else:  # an additive mask the size of ``hidden``: broadcast addition is several times faster than masked_fill
        d = scores + torch.zeros(hidden.shape, dtype=scores.dtype, device=scores.device).masked_fill_(hidden, -math.inf)
    m = d.amax(dim=-1, keepdim=True)  # (L, B, H, 1)
    d.sub_(m).clamp_(min=_EXP_FLOOR)  # hidden keys: -inf - m, clamped like any other tiny term
    e = d.exp()
    z = e.sum(dim=-1)  # (L, B, H)
    heads_entropy = z.log() - d.mul_(e).sum(dim=-1) / z
    sink = (e[..., :sink_tokens].sum(dim=-1) / z).mean(dim=-1)  # (L, B)
    heads_max = m.squeeze(-1)
    summary = torch.stack(
        [heads_max.amax(dim=-1), heads_entropy.mean(dim=-1), sink, torch.zeros_like(sink)], dim=-1
    )
    return AttnStats(summary, heads_entropy, heads_max) if per_head else AttnStats(summary)
