"""Block-sparse top-k attention: read only the blocks the current query can attend to strongly (Quest).

Every block keeps a summary of its keys per layer and KV head: the per-channel
minimum and maximum. For a query ``q`` the largest score any key of the block can
reach is bounded by ``sum_c max(q_c * min_c, q_c * max_c)`` (Tang et al., Quest,
2024); attention reads the ``k`` blocks with the highest bound, plus the sink
blocks at the start of the sequence (attention sinks, which a softmax leans on)
and the local window of the newest blocks. Query heads that share a KV head
(GQA) choose together, each head's bound taken relative to its best block, so a
block one head needs is not crowded out by another head's larger scores.

A decode step really reads only the chosen blocks: their rows are gathered from
the arena (and decoded by the codec), nothing else is touched. A multi-token
chunk (prefill) lets each query choose its own blocks, as it would when decoding
at that position, and masks the rest; every query's own block and the blocks
before it within the window are always in. When ``k`` covers every candidate, the
dense computation runs unchanged, so the two agree exactly.

Selection works over *pages* of ``sparse_block_size`` tokens, a multiple of the
cache's block size: a page's summary is the minimum and maximum over its blocks,
``k`` counts pages, the pages holding the sink blocks and the local window's blocks
are always read, and a chosen page reads every cache block it holds. Small cache blocks keep allocation and swaps fine-grained
while the choice stays at the 64-128 tokens where a key summary still bounds
scores tightly enough to be worth its read (Quest uses pages of 16-64 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..model.attention import AttnLayout, Newest, attend
from .protocol import Group, Step, StepFeature

__all__ = ["block_upper_bound", "quest_bound", "select_blocks", "chunk_block_mask", "KeySummaries", "BlockSparse", "SparseRead"]

_NEG = float("-inf")


def block_upper_bound(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q . k`` over the keys of each block: ``q`` (H_kv, g, S, D) grouped query
    heads, ``mins``/``maxs`` (H_kv, nb, D) per-channel key extremes. Returns (H_kv, g, S, nb)."""
    qf = q.float()[:, :, :, None, :]  # (H_kv, g, S, 1, D)
    lo, hi = mins.float()[:, None, None], maxs.float()[:, None, None]  # (H_kv, 1, 1, nb, D)
    return torch.maximum(qf * lo, qf * hi).sum(dim=-1)


def quest_bound(q: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Block scores for selection, (H_kv, S, nb): per query, each head's upper bound minus that
    head's best block, the max over the group's heads. 0 marks a block that is some head's best."""
    bound = block_upper_bound(q, mins, maxs)  # (H_kv, g, S, nb)
    bound = bound - bound.amax(dim=-1, keepdim=True)
    return bound.amax(dim=1)  # (H_kv, S, nb)


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores along the last dim; ties go to the earlier block, so a
    decode query and the same query inside a chunk choose alike (several heads' best blocks tie at 0)."""
    return score.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def select_blocks(score: torch.Tensor, num_blocks: int, k: int, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """Blocks one decode query reads: sinks, the top ``k`` by ``score`` (H_kv, nb) among the others, the local window.

    Returns (H_kv, n) block indices in position order, the same ``n`` for every head.
    """
    H_kv, nb = score.shape
    lo, hi = min(sink_blocks, num_blocks), max(num_blocks - local_blocks, 0)
    lo = min(lo, hi)
    fixed = torch.tensor(list(range(lo)) + list(range(hi, num_blocks)), dtype=torch.long, device=score.device)
    take = min(k, hi - lo)
    if take <= 0:
        return fixed.expand(H_kv, -1)
    top = _top(score[:, lo:hi], take) + lo  # (H_kv, take)
    return torch.cat([fixed.expand(H_kv, -1), top], dim=-1).sort(dim=-1).values


def chunk_block_mask(score: torch.Tensor, q_pos: torch.Tensor, block_size: int, k: int, sink_blocks: int,
                     local_blocks: int, blocks_per_page: int = 1) -> torch.Tensor:
    """Pages each query of a chunk may read: ``score`` (H_kv, S, np) per page of ``blocks_per_page`` cache
    blocks of ``block_size`` tokens, ``q_pos`` (S,) positions among the present tokens.

    Returns a bool mask (H_kv, S, np): the sink pages (those holding the first ``sink_blocks``
    blocks), the pages holding the query's own block and the ``local_blocks - 1`` blocks
    before it, and the top ``k`` of the pages in between.
    """
    H_kv, S, nb = score.shape
    r = blocks_per_page
    blk = torch.arange(nb, device=score.device)
    own_block = q_pos // block_size  # (S,)
    own = (own_block // r)[:, None]  # (S, 1): the query's own page
    first_local = ((own_block - local_blocks + 1).clamp_min(0) // r)[:, None]  # (S, 1)
    local = (blk[None] <= own) & (blk[None] >= first_local)  # (S, nb)
    sink = (blk < -(-sink_blocks // r))[None].expand(S, nb)
    cand = (blk[None] < first_local) & ~sink  # (S, nb)
    allowed = (local | (sink & (blk[None] <= own)))[None].expand(H_kv, S, nb).clone()
    take = min(k, nb)
    if take > 0 and bool(cand.any()):
        masked = score.masked_fill(~cand[None], _NEG)
        idx = _top(masked, take)  # (H_kv, S, take)
        vals = masked.gather(-1, idx)
        allowed.scatter_(-1, idx, vals > _NEG)
        allowed |= (local | (sink & (blk[None] <= own)))[None]
    return allowed


@dataclass
class _SeqSummary:
    blocks: list[Any] = field(default_factory=list)  # the pool's Block objects the rows below describe
    versions: list[int] = field(default_factory=list)
    data: torch.Tensor | None = None  # (L, nb, H_kv, 2, D): min, max per channel
    stale: list[int] = field(default_factory=list)  # indices to recompute in this step


class KeySummaries:
    """Per-block key minimum and maximum of each sequence, kept up to date as blocks are written.

    A summary belongs to one block object at one version: a block written this step,
    one that changed hands (copy-on-write, reused id) or one rolled back is summarised
    again from its stored keys, at every layer right after that layer's store.
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        c = cache.config
        self.shape = (c.num_layers, c.num_kv_heads, 2, c.head_dim)
        self._seqs: dict[Any, _SeqSummary] = {}

    def begin(self, seq: Any) -> None:
        """Line the summaries up with ``seq``'s blocks for this step; mark the ones to recompute."""
        s = self.cache.sequence(seq)
        old = self._seqs.get(seq) or _SeqSummary()
        where = {id(b): i for i, b in enumerate(old.blocks)}
        written = {id(b) for b, _, _ in s.writes}
        L, H, _, D = self.shape
        keep_src, keep_dst, stale = [], [], []
        for i, b in enumerate(s.blocks):
            j = where.get(id(b))
            if j is not None and old.versions[j] == b.version and id(b) not in written and old.blocks[j] is b:
                keep_src.append(j)
                keep_dst.append(i)
            else:
                stale.append(i)
        data = torch.zeros(L, len(s.blocks), H, 2, D, device=self.cache.device)
        if keep_src and old.data is not None:
            dev = self.cache.device
            data[:, torch.tensor(keep_dst, device=dev)] = old.data[:, torch.tensor(keep_src, device=dev)]
        self._seqs[seq] = _SeqSummary(list(s.blocks), [b.version for b in s.blocks], data, stale)

    def refresh(self, seq: Any, layer: int, plan: Any) -> None:
        """Summarise this layer of the blocks marked stale (their keys were just stored), read through the step's
        read ``plan``."""
        ss = self._seqs[seq]
        if not ss.stale:
            return
        cache, bs = self.cache, self.cache.block_size
        n_tok = cache.num_tokens(seq)
        idx = torch.tensor(ss.stale, dtype=torch.long)
        slots = torch.tensor([ss.blocks[i].slot for i in ss.stale], dtype=torch.long, device=cache.device)
        k, _ = plan.read_blocks(layer, slots)  # (n, H, bs, D)
        filled = (n_tok - idx * bs).clamp(0, bs).to(cache.device)  # tokens present in each block
        valid = (torch.arange(bs, device=cache.device)[None] < filled[:, None])[:, None, :, None]  # (n, 1, bs, 1)
        kf = k.float()
        mins = kf.masked_fill(~valid, float("inf")).amin(dim=2)
        maxs = kf.masked_fill(~valid, _NEG).amax(dim=2)
        ss.data[layer, idx.to(cache.device)] = torch.stack([mins, maxs], dim=2)  # (n, H, 2, D)

    def commit(self, seq: Any) -> None:
        """After the cache's commit: the summaries describe the blocks at their new versions."""
        ss = self._seqs.get(seq)
        if ss is not None:
            ss.versions = [b.version for b in ss.blocks]
            ss.stale = []

    def get(self, seq: Any, layer: int) -> torch.Tensor:
        """(nb, H_kv, 2, D) summaries of ``seq``'s blocks at ``layer``, in position order."""
        return self._seqs[seq].data[layer]

    def drop(self, seq: Any) -> None:
        self._seqs.pop(seq, None)


@dataclass
class SparseRead:
    """What one step's attention read, for the ``read`` events and the byte counts."""

    blocks: dict[Any, set[int]] = field(default_factory=dict)  # seq -> indices into its block table
    rows_read: int = 0  # (layer, kv head, block) rows read
    rows_dense: int = 0  # rows dense attention would have read


class BlockSparse(StepFeature):
    """Top-k page retrieval for the runner: summaries, selection, the sparse gather and attention.

    ``attend`` (the protocol's) takes each layer's attention of a group of rows over from dense attention;
    on a step that wants it (``Step.block_mass``), it adds the attention probability each block received,
    summed over heads and queries, for importance eviction; on a statistics step it returns the newest
    query's scaled scores over the keys it read, for the ``attn`` statistics. A page is ``blocks_per_page``
    cache blocks; ``k`` counts pages, and the pages holding the ``sink_blocks`` first and ``local_blocks``
    newest blocks are always read.
    """

    changes_attention = True

    def __init__(self, cache: Any, *, k: int, sink_blocks: int = 1, local_blocks: int = 1,
                 blocks_per_page: int = 1, dense_prefill: bool = False, dense_layers: int = 0) -> None:
        if blocks_per_page < 1:
            raise ValueError(f"blocks_per_page={blocks_per_page}: must be >= 1")
        self.cache = cache
        self.k, self.sink_blocks, self.local_blocks = k, sink_blocks, local_blocks
        self.blocks_per_page = blocks_per_page
        self.dense_prefill = dense_prefill  # a chunk of several queries reads every block (Quest's dense prefill)
        self.dense_layers = dense_layers  # layers below this read every block (Quest's dense first layers)
        self.summaries = KeySummaries(cache)
        self.read = SparseRead()
        self._step = Step(())  # the step being computed: its ``ReadPlan`` (the chosen blocks are read through it)

    @classmethod
    def for_cache(cls, cache: Any) -> BlockSparse | None:
        """What ``cache``'s config asks for: top-k reads, or (``k`` unbounded) the attention mass H2O needs."""
        c = cache.config
        if not c.topk and c.importance != "h2o":
            return None
        page = getattr(c, "sparse_block_size", 0) or c.block_size
        return cls(cache, k=c.topk or 1 << 30, sink_blocks=c.sink_blocks, local_blocks=c.local_blocks,
                   blocks_per_page=page // c.block_size, dense_prefill=bool(getattr(c, "dense_prefill", False)),
                   dense_layers=getattr(c, "dense_layers", 0))

    def read_ids(self, seq: Any, ids: Sequence[int]) -> list[int]:
        """Ids of the blocks of ``seq`` this step's attention read (any layer or head), in position order, of its
        block ids ``ids`` (the step's read plan's)."""
        return [ids[i] for i in sorted(self.read.blocks.get(seq, ())) if i < len(ids)]

    @property
    def bytes_read(self) -> int:
        """KV bytes this step's attention read: (layer, KV head) rows of the chosen blocks."""
        return self.read.rows_read * self.cache.config.row_bytes

    @property
    def bytes_dense(self) -> int:
        return self.read.rows_dense * self.cache.config.row_bytes

    def begin_step(self, step: Step) -> None:
        self.read, self._step = SparseRead(), step
        for seq in step.seqs:
            self.summaries.begin(seq)

    def after_store(self, layer: int, seqs: Sequence[Any]) -> None:
        for seq in seqs:
            self.summaries.refresh(seq, layer, self._step.plan)

    def attend(self, layer: int, q: torch.Tensor, group: Group, scale: float) -> tuple[torch.Tensor, Newest | None]:
        """The protocol's: block-sparse attention of ``group`` in place of dense attention, adding each row's mass
        per block to ``Step.block_mass`` when some feature ranks blocks by it."""
        step = self._step
        o, mass, scores = self.attend_table(layer, q, group.seqs, group.blocks.slots, group.layout, group.lens, scale,
                                            want_mass=step.block_mass is not None, want_scores=step.want_scores,
                                            key_bias=group.key_bias[layer] if group.key_bias is not None else None)
        if mass is not None:
            for seq, row, m in zip(group.seqs, group.rows, mass):
                step.block_mass.append((seq, step.plan.block_ids(row), m))
        return o, scores

    def after_commit(self, step: Step) -> None:
        for seq in step.seqs:
            self.summaries.commit(seq)

    # ---- pages ----
    def _num_pages(self, num_blocks: int) -> int:
        return -(-num_blocks // self.blocks_per_page)

    def _fixed_pages(self, num_blocks: int) -> tuple[int, int]:
        """(sink pages, local pages) of a decode query over ``num_blocks``: the pages holding the first
        ``sink_blocks`` blocks, and those holding the newest ``local_blocks``."""
        r, n_pages = self.blocks_per_page, self._num_pages(num_blocks)
        first_local = max(num_blocks - self.local_blocks, 0) // r
        return min(-(-self.sink_blocks // r), n_pages), n_pages - first_local

    def covers_all(self, num_blocks: int) -> bool:
        """True when ``k`` reaches every page between the sinks and the window: sparse is dense."""
        sinks, local = self._fixed_pages(num_blocks)
        return self.k >= self._num_pages(num_blocks) - sinks - local

    def _reads_all(self, layer: int, num_queries: int) -> bool:
        """Every block is read: one of the ``dense_layers``, or a chunk of several queries with ``dense_prefill``."""
        return layer < self.dense_layers or (self.dense_prefill and num_queries > 1)

    def _page_score(self, q: torch.Tensor, seq: Any, layer: int, num_blocks: int) -> torch.Tensor:
        """Selection scores (H_kv, S, np) of queries ``q`` (H, S, D) against each page's key summary."""
        H, S, D = q.shape
        H_kv, r = self.cache.config.num_kv_heads, self.blocks_per_page
        summ = self.summaries.get(seq, layer)[:num_blocks]  # (nb, H_kv, 2, D)
        if r > 1:
            pad = self._num_pages(num_blocks) * r - num_blocks  # missing blocks of the last page: no keys
            lo = F.pad(summ[:, :, 0], (0, 0, 0, 0, 0, pad), value=float("inf")).unflatten(0, (-1, r)).amin(dim=1)
            hi = F.pad(summ[:, :, 1], (0, 0, 0, 0, 0, pad), value=_NEG).unflatten(0, (-1, r)).amax(dim=1)
        else:
            lo, hi = summ[:, :, 0], summ[:, :, 1]  # (np, H_kv, D)
        return quest_bound(q.view(H_kv, H // H_kv, S, D), lo.transpose(0, 1), hi.transpose(0, 1))

    def _page_blocks(self, pages: torch.Tensor) -> torch.Tensor:
        """Cache-block indices (..., n * r) of pages (..., n), page by page; some may be past the last block."""
        r = self.blocks_per_page
        return (pages[..., None] * r + torch.arange(r, device=pages.device)).flatten(-2)

    def attend_table(self, layer: int, q: torch.Tensor, seqs: Sequence[Any], table: torch.Tensor, layout: AttnLayout,
                     kv_lens: Sequence[int], scale: float, *, want_mass: bool = False, want_scores: bool = False,
                     key_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None, Newest | None]:
        """Attention of ``q`` (B, H, S, D) for rows ``seqs`` with block ``table`` (B, nb) of device slots.

        Returns the output (B, H, S, D); with ``want_mass``, per row the attention mass on each
        of its blocks (nb_row,) summed over heads and queries; with ``want_scores``, each row's
        newest query's scaled scores (B, H, T) over its keys (``Newest``), the keys it did not read at the
        lowest finite value (no probability, and no non-finite count in the statistics). ``key_bias``
        (B, H_kv, T): token merging's score bias of each key (``engine.kv.merge``), added to what is read.
        """
        B, H, S, D = q.shape
        nbs = [-(-t // self.cache.block_size) for t in kv_lens]
        H_kv = self.cache.config.num_kv_heads
        for r, seq in enumerate(seqs):
            self.read.rows_dense += nbs[r] * H_kv
        if not want_mass and (self._reads_all(layer, S) or all(self.covers_all(nb) for nb in nbs)):
            out, scores = self._dense(layer, q, seqs, table, layout, kv_lens, nbs, scale, want_scores, key_bias)
            return out, None, scores
        if S == 1 and not want_mass:
            out, scores = self._decode(layer, q, seqs, table, kv_lens, nbs, scale, want_scores, key_bias)
            return out, None, scores
        return self._masked(layer, q, seqs, table, kv_lens, nbs, scale, want_mass, want_scores, key_bias)

    def choose(self, q: torch.Tensor, seq: Any, layer: int, num_blocks: int, kv_len: int) -> torch.Tensor | None:
        """The blocks each query of ``q`` (H, S, D), the row's newest tokens, reads: (H_kv, S, num_blocks) bool,
        the same choice ``attend_table`` makes (a decode query's top-k pages, a chunk's per-query pages); None when
        every block is read. Long context (``engine.features.streaming``) reads these wherever they are."""
        S, r = q.shape[1], self.blocks_per_page
        if self._reads_all(layer, S) or self.covers_all(num_blocks):
            return None
        score = self._page_score(q, seq, layer, num_blocks)  # (H_kv, S, np)
        if S == 1:
            sinks, local = self._fixed_pages(num_blocks)
            pages = select_blocks(score[:, 0], self._num_pages(num_blocks), self.k, sinks, local)  # (H_kv, n)
            sel = self._page_blocks(pages)  # (H_kv, n * r)
            mask = torch.zeros(sel.shape[0], self._num_pages(num_blocks) * r, dtype=torch.bool, device=q.device)
            return mask.scatter_(1, sel, True)[:, None, :num_blocks]
        q_pos = torch.arange(kv_len - S, kv_len, device=q.device)
        pages = chunk_block_mask(score, q_pos, self.cache.block_size, self.k, self.sink_blocks, self.local_blocks, r)
        return pages.repeat_interleave(r, dim=-1)[..., :num_blocks]

    # ---- paths ----
    def _gather(self, layer: int, table: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, nb = table.shape
        kb, vb = self._step.plan.read_blocks(layer, table)  # (B, nb, H_kv, bs, D) each
        bs, H_kv, D = kb.shape[3], kb.shape[2], kb.shape[4]
        k = kb.transpose(1, 2).reshape(B, H_kv, nb * bs, D)[:, :, :T]  # (B, H_kv, T, D)
        v = vb.transpose(1, 2).reshape(B, H_kv, nb * bs, D)[:, :, :T]
        return k, v

    def _dense(self, layer, q, seqs, table, layout, kv_lens, nbs, scale, want_scores=False, key_bias=None):
        """Every block is chosen: the runner's own dense computation, so the two agree exactly."""
        k, v = self._gather(layer, table, max(kv_lens))
        out, newest = attend(q, k, v, layout, scale=scale, scores=want_scores, key_bias=key_bias)
        H_kv = k.shape[1]
        for r, seq in enumerate(seqs):
            self.read.blocks.setdefault(seq, set()).update(range(nbs[r]))
            self.read.rows_read += nbs[r] * H_kv
        return out, newest

    def _decode(self, layer: int, q: torch.Tensor, seqs, table, kv_lens, nbs, scale, want_scores=False, key_bias=None):
        """One query per row: gather only the chosen pages' block rows (per KV head) and attend over them."""
        cache, bs = self.cache, self.cache.block_size
        B, H, _, D = q.shape
        H_kv = cache.config.num_kv_heads
        g = H // H_kv
        picks = []
        for r, seq in enumerate(seqs):
            score = self._page_score(q[r], seq, layer, nbs[r])  # (H_kv, 1, np)
            sinks, local = self._fixed_pages(nbs[r])
            pages = select_blocks(score[:, 0], self._num_pages(nbs[r]), self.k, sinks, local)  # (H_kv, n)
            sel = self._page_blocks(pages)  # (H_kv, n * r), in position order
            picks.append(sel)
            real = sel < nbs[r]  # the last page may reach past the last block
            self.read.blocks.setdefault(seq, set()).update(sel[real].unique().tolist())
            self.read.rows_read += int(real.sum())
        n = max(p.shape[1] for p in picks)
        sel = torch.zeros(B, H_kv, n, dtype=torch.long, device=q.device)
        ok = torch.zeros(B, H_kv, n, bs, dtype=torch.bool, device=q.device)
        tok = torch.arange(bs, device=q.device)
        for r, p in enumerate(picks):
            m = p.shape[1]
            sel[r, :, :m] = p.clamp_max(nbs[r] - 1)  # a block past the last is masked out below
            ok[r, :, :m] = (p[..., None] * bs + tok) < kv_lens[r]  # the tail block is partly filled
        slots = table.gather(1, sel.view(B, -1)).view(B, H_kv, n)  # (B, H_kv, n) device slots
        heads = torch.arange(H_kv, device=q.device)[None, :, None].expand(B, H_kv, n)
        k, v = self._step.plan.read_blocks(layer, slots, heads)  # (B, H_kv, n, bs, D): only the chosen rows
        k, v = k.reshape(B, H_kv, n * bs, D), v.reshape(B, H_kv, n * bs, D)
        mask = ok.view(B, H_kv, 1, n * bs).repeat_interleave(g, dim=1)  # (B, H, 1, n*bs)
        bias = None
        if key_bias is not None:  # token merging: each read key's log(count), dead slots hidden
            at = (sel[..., None] * bs + tok).clamp_max(key_bias.shape[-1] - 1).view(B, H_kv, n * bs)
            bias = key_bias.gather(-1, at).to(q.dtype)  # (B, H_kv, n*bs)
            mask = bias[:, :, None].repeat_interleave(g, dim=1).masked_fill(~mask, float("-inf"))
        if not want_scores:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1), None
        raw = (q.view(B, H_kv, g, D) @ k.transpose(-1, -2)).mul_(scale)  # (B, H_kv, g, n*bs)
        if bias is not None:
            raw += bias[:, :, None]
        low = torch.finfo(raw.dtype).min
        raw = raw.masked_fill(~ok.view(B, H_kv, 1, n * bs), low)
        probs = torch.softmax(raw, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).view(B, H, 1, D)
        # the newest query's scores in key positions: what was not read stays at the lowest finite value
        T = max(kv_lens)
        pos = (sel[..., None] * bs + tok).view(B, H_kv, 1, n * bs)
        pos = pos.masked_fill(~ok.view(B, H_kv, 1, n * bs), T).expand(B, H_kv, g, n * bs)  # unread -> a spare column
        scores = raw.new_full((B, H_kv, g, T + 1), low).scatter_(-1, pos, raw)
        return out, Newest(scores[..., :T].reshape(B, H, T))

    def _masked(self, layer, q, seqs, table, kv_lens, nbs, scale, want_mass, want_scores=False, key_bias=None):
        """Queries choose their own pages (prefill chunks, or any step that needs attention mass)."""
        cache, bs = self.cache, self.cache.block_size
        B, H, S, D = q.shape
        H_kv = cache.config.num_kv_heads
        g = H // H_kv
        T = max(kv_lens)
        k, v = self._gather(layer, table, T)
        allowed = torch.zeros(B, H, S, T, dtype=torch.bool, device=q.device)
        for r, seq in enumerate(seqs):
            nb, t = nbs[r], kv_lens[r]
            q_pos = torch.arange(t - S, t, device=q.device)  # the row's queries are its newest tokens
            causal = torch.arange(T, device=q.device)[None] <= q_pos[:, None]  # (S, T)
            if self._reads_all(layer, S) or self.covers_all(nb):
                blocks = torch.ones(H_kv, S, nb, dtype=torch.bool, device=q.device)
            else:
                score = self._page_score(q[r], seq, layer, nb)  # (H_kv, S, np)
                pages = chunk_block_mask(score, q_pos, bs, self.k, self.sink_blocks, self.local_blocks,
                                         self.blocks_per_page)
                blocks = pages.repeat_interleave(self.blocks_per_page, dim=-1)[..., :nb]  # (H_kv, S, nb)
            used = blocks.any(dim=1)  # (H_kv, nb): read by some query of the chunk
            self.read.blocks.setdefault(seq, set()).update(used.any(dim=0).nonzero().flatten().tolist())
            self.read.rows_read += int(used.sum())
            tokens = blocks.repeat_interleave(bs, dim=-1)[..., :T]  # (H_kv, S, <= T)
            tokens = F.pad(tokens, (0, T - tokens.shape[-1]))  # a row shorter than the batch's longest: no keys there
            tokens = tokens & causal[None] & (torch.arange(T, device=q.device) < t)
            allowed[r] = tokens.repeat_interleave(g, dim=0)
        bias = None if key_bias is None else key_bias.to(q.dtype).repeat_interleave(g, dim=1)[:, :, None]  # (B, H, 1, T)
        if not (want_mass or want_scores):
            mask = allowed if bias is None else bias.expand_as(allowed).masked_fill(~allowed, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)
            return out, None, None
        qg = q.reshape(B, H_kv, g * S, D)
        scores = (qg @ k.transpose(-1, -2)).mul_(scale).view(B, H, S, T)
        if bias is not None:
            scores += bias
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs.view(B, H_kv, g * S, T) @ v).view(B, H, S, D)
        mass = None
        if want_mass:
            per_tok = probs.float().sum(dim=(1, 2))  # (B, T): mass each key received
            nb_max = table.shape[1]
            padded = F.pad(per_tok, (0, nb_max * bs - T)).view(B, nb_max, bs).sum(-1)  # (B, nb)
            mass = [padded[r, : nbs[r]] for r in range(B)]
        return out, mass, Newest(scores[:, :, -1]) if want_scores else None
