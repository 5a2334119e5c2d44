"""Attention over a step's ``ReadPlan``: device blocks in place, slower tiers' blocks through the staging area.

Each row's keys come in parts (chunks of streamed blocks no larger than the staging area, the first one
read together with the row's device-resident blocks). Attention over each part gives an output normalised
within the part and the part's log-sum-exp of scores; ``merge`` weighs the parts by ``exp(lse_i - lse)``
(the share of the softmax's denominator each part holds), which is the softmax over all keys exactly, up to
rounding: dense attention streamed this way gives the tokens attention over fully resident blocks gives.

With block-sparse top-k the selector (``BlockSparse.choose``) names the blocks each query reads, and only
those are read: the chosen device blocks in place, the chosen slower-tier blocks through staging.
``StreamedStep`` records what each row read, from where and at which version, for the ``read``, ``stage``
and ``prefetch_use`` events and the byte counts; each row's newest query's mass and scores go to the ``Step``,
which the runner books as it books its own attention's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..kv.readplan import BlockLoc, ReadPlan, RowPlan
from ..kv.staging import StagingArea
from .protocol import Step, StepFeature

__all__ = ["partial_attention", "merge", "StreamedAttention", "StreamedStep"]


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (H, S, D) over one part's keys ``k``, ``v`` (H_kv, T, D) where ``allowed``
    (H_kv or 1, S, T) says which key each query sees (None: every key, as for a part wholly before the queries).

    Returns the output normalised within the part (H, S, D), float32 (zero where a query sees no key),
    its log-sum-exp of scaled scores (H, S) (-inf there), and the newest query's scaled scores (H, T), -inf
    where it does not see the key (the attention statistics and the placement policy's mass come from them)."""
    H, S, D = q.shape
    H_kv, T = k.shape[0], k.shape[1]
    g = H // H_kv
    raw = (q.reshape(H_kv, g * S, D) @ k.transpose(-1, -2)).float().mul_(scale).view(H_kv, g, S, T)
    if allowed is not None:
        raw = raw.masked_fill(~allowed[:, None], -math.inf)
    lse = torch.logsumexp(raw, dim=-1)  # (H_kv, g, S)
    probs = torch.exp(raw - lse[..., None])
    if allowed is not None:
        probs.nan_to_num_(0.0)  # a query with no key here: -inf - -inf
    out = (probs.view(H_kv, g * S, T) @ v.float()).view(H, S, D)
    return out, lse.view(H, S), raw[:, :, -1].reshape(H, T)


def merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over all parts' keys from each part's ``(out (H, S, D), lse (H, S))``: (out, lse)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p[1] for p in parts])  # (P, H, S)
    total = torch.logsumexp(lse, dim=0)  # (H, S)
    w = torch.exp(lse - total).nan_to_num_(0.0)  # each part's share of the denominator
    out = sum(wi[..., None] * p[0] for wi, p in zip(w, parts))
    return out, total


@dataclass
class StreamedStep:
    """What one step's streamed attention read (any layer), per row."""

    # seq -> block id -> (tier the copy read came from, the oldest version read of it, its place in the table)
    reads: dict[Any, dict[int, tuple[str, int, int]]] = field(default_factory=dict)
    device_rows: int = 0  # (layer, block) reads served by a resident copy
    staged_rows: int = 0  # (layer, block) reads served through the staging area


class StreamedAttention(StepFeature):
    """Per layer, attention for every row of a ``ReadPlan``; one instance per runner. It changes attention on
    the steps whose plan streams (some row has blocks off the device), and on those books what was read."""

    def __init__(self, cache: Any, staging: StagingArea, sparse: Any = None) -> None:
        self.cache, self.staging, self.sparse = cache, staging, sparse
        self.plan: ReadPlan | None = None
        self.streamed = StreamedStep()  # what this step read, from where
        self._step = Step(())  # the runner's step: where each row's tokens start, and what attention saw

    @property
    def changes_attention(self) -> bool:
        return self.plan is not None and self.plan.streaming

    def begin_step(self, step: Step) -> None:
        self.plan, self.streamed, self._step = step.plan, StreamedStep(), step
        self._masks: dict[tuple, torch.Tensor | None] = {}  # the step's causal masks per part: the same for every layer

    def after_commit(self, step: Step) -> None:
        """What was read from where (``read``, ``stage`` and ``prefetch_use`` events); top-k prefetches its picks."""
        if self.changes_attention:
            st = self.streamed
            self.cache.book_streamed(st.reads, st.device_rows, st.staged_rows, predict=self.sparse is not None)

    def attend_step(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Output (N, H*D) of every row's tokens ``q`` (N, H, D), on a step that streams; row ``r``'s tokens start
        at ``Step.starts[r]``."""
        if not self.changes_attention:
            return None
        N, H, D = q.shape
        out = q.new_empty(N, H * D)
        for row, start in zip(self.plan.rows, self._step.starts):
            qr = q[start : start + row.q_len].transpose(0, 1)  # (H, S, D)
            o = self._row(layer, qr, row, scale)  # (H, S, D)
            out[start : start + row.q_len] = o.transpose(0, 1).reshape(row.q_len, H * D).to(q.dtype)
        return out

    def _row(self, layer: int, q: torch.Tensor, row: RowPlan, scale: float) -> torch.Tensor:
        choice = None
        if self.sparse is not None:
            choice = self.sparse.choose(q, row.seq, layer, row.num_blocks, row.kv_len)  # (H_kv, S, nb)
        wanted = None if choice is None else choice.any(dim=1).any(dim=0).tolist()  # (nb,) read by some head
        reads = self.streamed.reads.setdefault(row.seq, {})
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        lasts: list[tuple[tuple[BlockLoc, ...], torch.Tensor]] = []
        resident = tuple(b for b in row.resident if wanted is None or wanted[b.pos])
        streamed = tuple(b for b in row.streamed if wanted is None or wanted[b.pos])
        cap = self.staging.capacity
        # The resident blocks ride with the first staged chunk: one part fewer to attend over and merge, and the
        # device holds no more than it does anyway (the resident rows gathered, and the staging area's).
        for i in range(0, max(len(streamed), 1), cap):
            chunk = streamed[i : i + cap]
            locs, ks, vs = [], [], []
            if i == 0 and resident:
                slots = torch.tensor([b.slot for b in resident], dtype=torch.long, device=self.cache.device)
                k, v = self.plan.read_blocks(layer, slots)  # (n, H_kv, bs, D) each
                locs.extend(resident), ks.append(k), vs.append(v)
                for b in resident:
                    self._note(reads, b, "device", b.version)
                self.streamed.device_rows += len(resident)
            if chunk:
                k, v, versions = self.staging.load(layer, row.seq, chunk)
                locs.extend(chunk), ks.append(k), vs.append(v)
                for b, ver in zip(chunk, versions):
                    self._note(reads, b, b.tier, ver)
                self.streamed.staged_rows += len(chunk)
            if locs:
                k, v = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))
                self._part(q, k, v, tuple(locs), row, choice, scale, parts, lasts)
        out, lse = merge(parts)
        if self._step.want_mass:
            self._add_mass(row, lasts, lse)
        if self._step.want_scores:
            self._add_scores(row, lasts)
        return out

    @staticmethod
    def _note(reads: dict[int, tuple[str, int, int]], b: BlockLoc, tier: str, version: int) -> None:
        seen = reads.get(b.block)
        if seen is None or version < seen[1]:
            reads[b.block] = (tier, version, b.pos)

    def _part(self, q, k, v, locs, row: RowPlan, choice, scale, parts, lasts) -> None:
        """Attention over one part's blocks ``k``, ``v`` (n, H_kv, bs, D), appended to ``parts``."""
        n, H_kv, bs, D = k.shape
        keys = k.transpose(0, 1).reshape(H_kv, n * bs, D)
        vals = v.transpose(0, 1).reshape(H_kv, n * bs, D)
        kv_len = row.kv_len
        key = (kv_len, row.q_len, tuple(b.index for b in locs))
        if key in self._masks:
            allowed = self._masks[key]
        else:
            index = torch.tensor(key[2], device=q.device)
            pos = (index[:, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)  # (n*bs,) key positions
            q_pos = torch.arange(kv_len - row.q_len, kv_len, device=q.device)  # the row's queries are its newest
            allowed = ((pos[None, :] <= q_pos[:, None]) & (pos[None, :] < kv_len))[None]  # (1, S, T)
            self._masks[key] = allowed = None if bool(allowed.all()) else allowed  # older keys: no mask to apply
        if choice is not None:
            picked = choice[:, :, torch.tensor([b.pos for b in locs], device=q.device)]  # (H_kv, S, n)
            picked = picked.repeat_interleave(bs, dim=-1)
            allowed = picked if allowed is None else allowed & picked
        out, lse, last = partial_attention(q, keys, vals, allowed, scale)  # last: newest query's scores (H, n*bs)
        parts.append((out, lse))
        lasts.append((locs, last))

    def _add_mass(self, row: RowPlan, lasts, lse: torch.Tensor) -> None:
        """The newest query's attention mass per block (summed over heads), for the placement policy."""
        L = self.cache.config.num_layers
        mass = self._step.newest_mass.setdefault(row.seq, torch.zeros(row.num_blocks))
        for locs, last in lasts:
            probs = torch.exp(last - lse[:, -1:]).nan_to_num_(0.0)  # (H, n*bs): shares of the softmax over all parts
            per_block = probs.view(last.shape[0], len(locs), -1).sum(dim=(0, 2))  # (n,)
            mass[torch.tensor([b.pos for b in locs])] += per_block.cpu() / L

    def _add_scores(self, row: RowPlan, lasts) -> None:
        """The newest query's scores over the row's key positions (H, kv_len), from each part's, for the ``attn``
        statistics: a key not read (top-k) holds the lowest finite value (no probability, and not counted as
        non-finite)."""
        bs = self.cache.config.block_size
        H = lasts[0][1].shape[0]
        full = lasts[0][1].new_full((H, row.num_blocks * bs), torch.finfo(lasts[0][1].dtype).min)
        for locs, last in lasts:
            table_pos = torch.tensor([b.pos for b in locs], device=full.device)
            pos = (table_pos[:, None] * bs + torch.arange(bs, device=full.device)).reshape(-1)  # (n*bs,)
            full[:, pos] = last.clamp_min(torch.finfo(last.dtype).min)  # -inf (not read, or past the end) -> lowest
        self._step.newest_scores.setdefault(row.seq, []).append(full[:, : row.kv_len])
