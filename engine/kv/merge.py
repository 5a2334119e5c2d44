"""Token merging: adjacent tokens of an old block whose keys are nearly the same share one slot, with a count.

A block that is full and old (not a sink, outside the sequence's recent window) is looked at once. In each
(layer, KV head) row of it, tokens are taken left to right: a token joins the open cluster when the cosine
similarity of its key with the cluster's mean key is at least the threshold, and opens a new cluster
otherwise. Each cluster becomes one slot holding the count-weighted mean of its keys and of its values, with
its count; the clusters fill the row's first slots and the slots after them are dead (count 0).

Attention adds ``log(count)`` to a merged slot's score (and hides dead slots): ``c`` identical keys ``k`` with
values ``v_i`` give ``sum_i exp(q.k) v_i = exp(q.k + log c) * mean(v)``, so for identical keys the merged slot
is exactly the tokens it replaced; for nearly identical keys the error is in the keys' spread.

*Per (layer, KV head)*, not per layer: in SmolLM2 the KV heads of one layer differ widely in how alike
adjacent keys are (layer 0: a median adjacent cosine of 0.46 in one head, 0.81 in another), so a rule that
merges only where every head agrees merges far less at the same threshold, and each (layer, head) row of a
block is contiguous in the arena, so it compacts on its own.

What stays true: a merged block keeps its id, its positions (``index``), its tier slot and its version (a
``merge`` event, not a write); its bytes change, so its content digest is taken again (``new_digest``). A
block owned by more than one sequence or by the prefix cache is never merged (its other readers expect its
tokens), nor one in flight or off the device. The counts live in merging's side table (``PagedKVCache.merged``, by block id) and travel
with it between tiers; the bytes of dead slots still travel too (the arena keeps whole blocks): what
merging saves is *live* slots (``live_rows``), which a ragged store would hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["SlotCounts", "key_bias", "merge_rows", "DEAD_BIAS"]

# The score bias of a dead slot: finite, so attention statistics see a number (their -inf test stays for real
# faults), half the float32 range, so adding it to a padding mask's lowest value cannot overflow.
DEAD_BIAS = torch.finfo(torch.float32).min / 2
_ROUNDING = 1e-6  # float32 rounding of a cosine near 1


@dataclass(frozen=True)
class SlotCounts:
    """What token merging left in a block: ``counts`` (L, H_kv, block_size), the tokens each slot holds
    (0: dead), or None when no row shrank (the block was looked at and stays whole)."""

    counts: torch.Tensor | None

    @property
    def live(self) -> int:
        """Live (layer, head, slot) rows."""
        return int((self.counts > 0).sum()) if self.counts is not None else -1

    @cached_property
    def bias(self) -> torch.Tensor:
        """(L, H_kv, block_size) float32 score bias of the slots: ``log(count)``, ``DEAD_BIAS`` where dead (taken
        once: a merged block never changes again, and every step's attention needs it)."""
        c = self.counts.float()
        return torch.where(c > 0, c.clamp_min(1).log(), torch.full_like(c, DEAD_BIAS))


def key_bias(rows: Sequence[Sequence[SlotCounts | None]], *, num_layers: int, num_kv_heads: int, block_size: int,
             width: int, device: torch.device | str) -> torch.Tensor | None:
    """The score bias of each key slot for a batch whose row ``r`` reads blocks ``rows[r]`` (position order;
    ``width`` blocks per row, short rows padded): ``log(count)`` of merged slots, ``DEAD_BIAS`` of dead ones, 0
    elsewhere, as (L, B, H_kv, width * block_size) float32. None when no block of the batch shrank."""
    if not any([m is not None and m.counts is not None for row in rows for m in row]):
        return None
    zero = torch.zeros(num_layers, num_kv_heads, block_size, device=device)
    per_row = []
    for row in rows:
        blocks = [m.bias.to(device) if m is not None and m.counts is not None else zero for m in row]
        blocks += [zero] * (width - len(blocks))
        per_row.append(torch.stack(blocks, dim=2))  # (L, H_kv, width, bs)
    return torch.stack(per_row, dim=1).view(num_layers, len(rows), num_kv_heads, width * block_size)


def merge_rows(k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, threshold: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge each row of ``k``, ``v`` (R, bs, D) whose slots hold ``counts`` (R, bs) tokens (0: dead, only
    after the live ones). Returns merged K and V (R, bs, D) float32 (dead slots zero) and counts (R, bs).

    The walk over positions is sequential (whether a token joins depends on the cluster before it), so it
    works on per-row scalars only: the cosine of the open cluster's key sum ``s`` with ``k_j`` comes from the
    rows' Gram matrices, ``s . k_j`` and ``|s|^2`` as differences of prefix sums (float64: the sums of
    products would lose the small clusters' terms in float32), and every step of the walk costs a few (R,)
    operations however long D is."""
    R, bs, D = k.shape
    w = counts.float()  # (R, bs)
    kf, vf = k.float(), v.float()
    gram = (kf @ kf.transpose(1, 2)).double()  # (R, bs, bs): k_i . k_j
    wd = w.double()
    weighted = gram * wd[:, :, None]  # w_i k_i . k_j
    dots = F.pad(weighted.cumsum(1), (0, 0, 1, 0))  # (R, bs+1, bs): [a, j] = sum_{i<a} w_i k_i . k_j
    sqs = F.pad((weighted * wd[:, None, :]).cumsum(1).cumsum(2), (1, 0, 1, 0))  # [a, b] = sum_{i<a, i'<b} w w k.k
    norms = gram.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()  # (R, bs): |k_j|
    rows = torch.arange(R, device=k.device)
    at_least = min(threshold, 1 - _ROUNDING)  # a threshold of 1 merges identical keys, whose cosine rounds below 1
    cluster = torch.zeros(R, bs, dtype=torch.long, device=k.device)
    start = torch.zeros(R, dtype=torch.long, device=k.device)  # first position of each row's open cluster
    for j in range(1, bs):
        dot = dots[rows, j, j] - dots[rows, start, j]  # (open cluster's weighted key sum) . k_j
        sq = sqs[rows, j, j] - sqs[rows, start, j] - sqs[rows, j, start] + sqs[rows, start, start]  # |sum|^2
        sim = dot / (sq.clamp_min(0).sqrt() * norms[:, j]).clamp_min(1e-8)  # as F.cosine_similarity
        # a dead slot joins with weight 0 (changes nothing)
        join = (w[:, j] == 0) | (sim >= at_least)
        cluster[:, j] = cluster[:, j - 1] + (~join).long()
        start = torch.where(join, start, j)
    idx = cluster[..., None].expand(R, bs, D)
    sum_k = torch.zeros_like(kf).scatter_add_(1, idx, kf * w[..., None])
    sum_v = torch.zeros_like(vf).scatter_add_(1, idx, vf * w[..., None])
    n = torch.zeros_like(w).scatter_add_(1, cluster, w)  # (R, bs): tokens per cluster, 0 past the last
    inv = torch.where(n > 0, 1.0 / n.clamp_min(1e-30), torch.zeros_like(n))[..., None]
    return sum_k * inv, sum_v * inv, n.round().to(counts.dtype)
