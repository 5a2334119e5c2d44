"""The cache's read path, and the one ``ReadPlan`` a step reads through.

Before a step's forward pass the runner asks the cache for its plan once (``PagedKVCache.plan_reads``): the
rows' blocks are made resident (with long context: split by where each is read from) and the plan holds what
attention needs to read them, built once for every layer: each group of rows' padded device block table,
where each block's K and V rows start in a layer's arena, each layer's view of the arena, token merging's
score bias. Attention reads K/V through the plan and never asks the cache where a block is, so the data path
stays one way: scheduler -> cache (plan) -> attention -> events (vLLM's per-step attention metadata is the
model).

The rest of reading lives here too: the device arena seen as rows of ``head_dim`` elements (``RowLayout``:
where a store lands, where a read starts; the compiled decode layers index it themselves), residency
(``Reads.ensure_resident``), each block decoded by its codec (``Reads.read_blocks``), and the ``read`` events
of what attention read, with the digests of the blocks the sampler picked to verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence

import torch

from ...events import Read
from ..config import Tier
from ..errors import OutOfBlocks
from .merge import key_bias
from .pool import Block
from .storage import TensorArena

if TYPE_CHECKING:
    from .cache import PagedKVCache
    from .sequences import SeqState

__all__ = ["BlockLoc", "RowPlan", "ReadPlan", "BlockTable", "plan_reads", "Reads", "RowLayout", "StorePlan"]


# ---- long context: each row's blocks by where they are read from ----
@dataclass(frozen=True, slots=True)
class BlockLoc:
    """One block of a row as the step finds it."""

    pos: int  # its place in the row's block table (the key positions pos*block_size ...), what top-k selects by
    index: int  # the block's position in its sequence: tokens index*block_size ... index*block_size + block_size - 1
    block: int  # block id
    tier: str
    slot: int  # tier slot (which arena and where in it)
    version: int  # version of the copy in that slot
    codec: str


@dataclass(frozen=True)
class RowPlan:
    """One row: its keys, its queries, and its blocks split by where they are read from."""

    seq: Any
    kv_len: int  # keys after this step's tokens are stored
    q_len: int  # this step's new tokens (the queries): positions kv_len - q_len ... kv_len - 1
    resident: tuple[BlockLoc, ...]  # on the device: read in place
    streamed: tuple[BlockLoc, ...]  # on a slower tier: read through the staging area
    chunks: tuple[tuple[BlockLoc, ...], ...]  # ``streamed`` in pieces that each fit the staging area

    @property
    def num_blocks(self) -> int:
        return len(self.resident) + len(self.streamed)


class BlockTable(NamedTuple):
    """What attention reads for a group of a step's rows, for every layer."""

    slots: torch.Tensor  # (B, num_blocks) device-arena slots of each row's blocks, short rows padded with their first
    kv_rows: torch.Tensor | None  # (2*B*H_kv*num_blocks,) where each block's keys, then values, start; None: decode
    extent: int  # rows of the strided arena view ``kv_rows`` indexes


class ReadPlan:
    """One step's reads. ``rows`` (long context): each row's blocks by where they are read from, empty when every
    block is on the device; then the plan reads them in place: ``table`` for a group of the step's rows,
    ``gather`` per layer, ``key_bias`` of merged blocks. ``layer_kv``: each layer's raw view of the device arena,
    None where blocks are stored as codes or in several codecs (``gather`` decodes them)."""

    def __init__(self, rows: tuple[RowPlan, ...] = (), staging_blocks: int = 0, reads: Reads | None = None,
                 states: Sequence[SeqState] = ()) -> None:
        self.rows, self.staging_blocks = rows, staging_blocks
        self._reads, self._states = reads, list(states)
        self.layer_kv = reads.raw_views() if reads is not None and states else None

    @property
    def streaming(self) -> bool:
        """Some row reads a block that is not on the device: attention must stream it."""
        return any(r.streamed for r in self.rows)

    def table(self, rows: Sequence[int]) -> BlockTable:
        """The block table of the step's ``rows`` (indices in the step's order): the mask hides the padding. A
        short row is padded with its own first block, never another sequence's: a hidden key still meets
        attention (its V times a zero probability, and 0 × NaN is NaN), so a NaN in a block of someone else's
        would reach this row (vLLM PR #43990's class)."""
        reads = self._reads
        tables = [reads.slots_of(self._states[i]) for i in rows]
        if len(tables) > 1:
            n = max(len(t) for t in tables)
            slots = torch.stack([t if len(t) == n else torch.cat((t, t[:1].expand(n - len(t)))) for t in tables])
        else:
            slots = tables[0][None]
        if self.layer_kv is None:
            return BlockTable(slots, None, 0)
        return BlockTable(slots, *reads.cache.layout.read_rows(slots))

    def gather(self, layer: int, t: BlockTable, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the table's rows at ``layer`` as ``dtype``, each (B, H_kv, kv_len, D)."""
        (B, nb), layout = t.slots.shape, self._reads.cache.layout
        H, D, bs = layout.num_kv_heads, layout.head_dim, layout.block_size
        if t.kv_rows is not None:
            # Overlapping rows of one block of one head (bs*D elements), one starting at every element of the
            # layer: a view, no copy.
            rows = self.layer_kv[layer].as_strided((t.extent, bs * D), (1, 1))
            kv = rows.index_select(0, t.kv_rows).view(2, B, H, nb * bs, D).to(dtype)
            return kv[0, :, :, :kv_len], kv[1, :, :, :kv_len]
        # Paged gather of every row's blocks at once, decoded by their codecs.
        kb, vb = (b.to(dtype) for b in self._reads.read_blocks(layer, t.slots))  # (B, nb, H_kv, bs, D) each
        k = kb.transpose(1, 2).reshape(B, H, nb * bs, D)[:, :, :kv_len]
        v = vb.transpose(1, 2).reshape(B, H, nb * bs, D)[:, :, :kv_len]
        return k, v

    def read_blocks(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``PagedKVCache.read_blocks`` for a feature that reads blocks of its own choosing (block-sparse top-k)."""
        return self._reads.read_blocks(layer, slots, heads)

    def key_bias(self, rows: Sequence[int], width: int) -> torch.Tensor | None:
        """Token merging's score bias of each key of the step's ``rows`` (L, B, H_kv, width * block_size); None
        when none of their blocks shrank (``engine.kv.merge``)."""
        c = self._reads.cache
        merged = c.merged
        if not merged:
            return None
        cfg = c.config
        return key_bias([[merged.get(b.id) for b in self._states[i].blocks] for i in rows], num_layers=cfg.num_layers,
                        num_kv_heads=cfg.num_kv_heads, block_size=c.block_size, width=width, device=c.device)

    def block_ids(self, row: int) -> list[int]:
        """Ids of the blocks row ``row`` of the step reads, in position order."""
        return [b.id for b in self._states[row].blocks]


def plan_reads(rows: Sequence[tuple[Any, int, int, Sequence[BlockLoc]]], staging_blocks: int,
               reads: Reads | None = None) -> ReadPlan:
    """The long-context plan for rows ``(seq, kv_len, q_len, blocks in position order)``: device blocks read in
    place, the rest in chunks of at most ``staging_blocks`` (in position order, so a chunk is a run of neighbouring
    blocks where the tier allows and a disk read is one sequential piece). ``reads``: the cache's, which the
    plan's ``read_blocks`` decodes device blocks by."""
    if staging_blocks < 1 and any(b.tier != "device" for _, _, _, blocks in rows for b in blocks):
        raise ValueError("a block off the device needs a staging area (staging_blocks >= 1)")
    out = []
    for seq, kv_len, q_len, blocks in rows:
        if not 1 <= q_len <= kv_len:
            raise ValueError(f"row {seq!r}: needs 1 <= q_len ({q_len}) <= kv_len ({kv_len})")
        resident = tuple(b for b in blocks if b.tier == "device")
        streamed = tuple(b for b in blocks if b.tier != "device")
        chunks = tuple(streamed[i : i + staging_blocks] for i in range(0, len(streamed), max(staging_blocks, 1)))
        out.append(RowPlan(seq, kv_len, q_len, resident, streamed, chunks))
    return ReadPlan(tuple(out), staging_blocks, reads)


# ---- the device arena as rows ----
class StorePlan(NamedTuple):
    """Where one step's reserved slots are written."""

    blk: torch.Tensor  # (N,) device slot of each token's block
    off: torch.Tensor  # (N,) its position in the block
    rows: torch.Tensor | None  # (2 * N * H,) rows of D elements in a layer's arena; None: index by blk/off
    extent: int  # rows in a layer's arena view


class RowLayout:
    """The device arena seen as rows of ``head_dim`` elements: where a step's stores land and where a read's keys
    and values start. The per-layer views and the last store plan are cached; they are dropped whenever the
    device arena reallocates (``forget``), since a view of the old tensor would write where nobody reads."""

    def __init__(self, dev: TensorArena, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 native: bool) -> None:
        self.dev, self.num_layers, self.block_size = dev, num_layers, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.native = native  # the device's codec stores the dtype as it is (rows of K/V, not codes)
        self._kv: list[torch.Tensor] | None = None  # per-layer views of the device arena
        self._plan: tuple[torch.Tensor, StorePlan] | None = None  # the last ``slots`` planned and its plan
        self._strides: tuple[tuple[int, int, int, int] | None] | None = None  # (row_strides,): None is an answer too

    def forget(self) -> None:
        """The device arena reallocated: every view and plan points into the old tensor."""
        self._kv = None
        self._plan = None
        self._strides = None

    def views(self) -> list[torch.Tensor]:
        """``(num_slots, H, 2, block_size, D)`` views of the device arena, one per layer."""
        if self._kv is None:
            self._kv = [self.dev.layer_kv(layer) for layer in range(self.num_layers)]
        return self._kv

    def layer_kv(self, layer: int) -> torch.Tensor:
        """``(num_slots, H, 2, block_size, D)`` view of the device arena for one layer."""
        return self.views()[layer]

    def plan(self, slots: torch.Tensor) -> StorePlan:
        """Where ``slots`` lie: block and offset, and for the device arena's own layout the (K/V, token, head)
        rows of D elements each token's heads go to in a layer's arena seen as (rows, D). The same for every
        layer (they share strides), so a step's layers reuse the plan of the one ``slots`` tensor they store."""
        if self._plan is not None and self._plan[0] is slots:
            return self._plan[1]
        blk, off = slots // self.block_size, slots % self.block_size
        rows, extent = None, 0
        strides = self.row_strides() if self.native else None
        if strides is not None:
            s_blk, s_head, s_kv, s_pos = strides
            kv = self.layer_kv(0)
            heads = torch.arange(kv.shape[1], device=slots.device)
            at = (blk * s_blk + off * s_pos)[:, None] + heads[None, :] * s_head  # (N, H) rows of K
            rows = torch.stack((at, at + s_kv)).view(-1)  # (2 * N * H,): K rows, then V rows
            extent = ((kv.shape[0] - 1) * s_blk + (kv.shape[1] - 1) * s_head + s_kv + (kv.shape[3] - 1) * s_pos) + 1
        plan = StorePlan(blk, off, rows, extent)
        self._plan = (slots, plan)
        return plan

    def read_rows(self, table: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """Where each block's keys, and its values, of each head start, as element offsets from a layer's
        start, ordered (K/V, row, head, block), for ``table`` (B, blocks) of device slots; and the extent
        they index. None where the arena is not such rows."""
        strides = self.row_strides()
        if strides is None:
            return None, 0
        D = self.head_dim
        s_blk, s_head, s_kv, _ = (st * D for st in strides)
        heads = torch.arange(self.num_kv_heads, device=table.device)
        key = table[:, None, :] * s_blk + heads[None, :, None] * s_head  # (B, H_kv, nb)
        rows = torch.stack([key, key + s_kv]).reshape(-1)  # (2*B*H_kv*nb,)
        return rows, int(rows.max()) + 1

    def row_strides(self) -> tuple[int, int, int, int] | None:
        """The device arena's strides in rows of D elements (block, head, K/V, position), the layout both the
        store plan and ``read_rows`` index; None where a layer's arena is not such rows."""
        if self._strides is None:
            kv = self.layer_kv(0)  # (P, H, 2, bs, D)
            D, strides = kv.shape[-1], kv.stride()
            rows = strides[-1] == 1 and strides[-2] == D and not any(st % D for st in strides[:-1])
            self._strides = (tuple(st // D for st in strides[:-1]) if rows else None,)
        return self._strides[0]


# ---- the cache's reads ----
class Reads:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._native = cache.codec.native  # the device's own codec stores the dtype as it is: raw views apply

    def read_plan(self, seqs: Sequence[Any]) -> ReadPlan:
        """The step's plan when every block of ``seqs`` is read on the device (``ensure_resident`` first)."""
        table = self.cache.seqs
        return ReadPlan(reads=self, states=[table[q] for q in seqs])

    def raw_views(self) -> list[torch.Tensor] | None:
        """Each layer's raw view of the device arena while every device block is in the device's own native
        codec; None otherwise (``read_blocks`` decodes them)."""
        ts = self.cache.pool.slots[Tier.DEVICE]
        return self.cache.layout.views() if self._native and ts.used_by[0] == ts.used else None

    # ---- residency ----
    def ensure_resident(self, seqs: Iterable[Any]) -> None:
        c = self.cache
        ss = [c.seqs.require(q) for q in seqs]
        step, mover = c.step, c.mover
        step.tick += 1
        blocks: dict[int, Block] = {}
        for s in ss:
            step.pinned.add(s.id)
            s.last_access = step.tick
            for b in s.blocks:
                blocks[b.id] = b
        cap = c.pool.slots[Tier.DEVICE].capacity
        if len(blocks) > cap:
            raise OutOfBlocks(Tier.DEVICE, len(blocks), cap)
        missing = []
        for b in blocks.values():
            b.last_access = step.tick
            if b.inflight is not None:
                mover.prefetch_hits += 1
                mover.settle(b)
                mover.take_prefetched(b)
            elif b.tier != Tier.DEVICE:
                missing.append(b)
            elif mover.take_prefetched(b):
                mover.prefetch_hits += 1
        if missing:
            mover.prefetch_misses += len(missing)
            mover.move(missing, Tier.DEVICE, exclude=set(blocks))
            for s in ss:
                s.index_cache = None

    def slot_table(self, seq: Any) -> torch.Tensor:
        return self.slots_of(self.cache.seqs.require(seq))

    def slots_of(self, s: SeqState) -> torch.Tensor:
        """``(num_blocks,)`` device slots of ``s``'s blocks, cached until a block moves, goes or joins."""
        c = self.cache
        cached = s.index_cache
        if cached is not None and cached[0] == c.pool.epoch:
            return cached[1]
        if any(b.tier != Tier.DEVICE or b.inflight is not None for b in s.blocks):
            self.ensure_resident([s.id])
        t = torch.tensor([b.slot for b in s.blocks], dtype=torch.long, device=c.device)
        s.index_cache = (c.pool.epoch, t)
        return t

    # ---- K/V ----
    def layer_kv(self, layer: int) -> torch.Tensor:
        c = self.cache
        if not self._native:
            raise ValueError(f"layer_kv is a raw view and the {c.codec.name} codec stores codes: use read_blocks")
        ts = c.pool.slots[Tier.DEVICE]
        if ts.used_by[0] != ts.used:
            held = {name: n for name, n in zip(c.devs.codecs[1:], ts.used_by[1:]) if n}
            raise ValueError(f"layer_kv is a raw view of the device's {c.codec.name} arena, and {ts.used - ts.used_by[0]} "
                             f"device blocks are held in other codecs ({held}): use read_blocks")
        return c.layout.layer_kv(layer)

    def read_blocks(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        ts = c.pool.slots[Tier.DEVICE]
        if ts.used_by[0] != ts.used:  # some device blocks are in other codecs' arenas
            return c.mixed.read(layer, slots, heads)
        if heads is None:
            rows = c.dev.data[:, layer].index_select(0, slots.reshape(-1))  # (n, H, R)
            k, v = c.codec.read(rows, layer)  # (n, H, bs, D) each
            return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])
        flat_heads = heads.reshape(-1)
        rows = c.dev.data[:, layer][slots.reshape(-1), flat_heads]  # (n, R)
        k, v = c.codec.read(rows[:, None], layer, flat_heads)  # (n, 1, bs, D) each
        return k.view(*slots.shape, *k.shape[2:]), v.view(*slots.shape, *v.shape[2:])

    def gather(self, seq: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        s = c.seqs.require(seq)
        idx = self.slots_of(s)
        if layer == 0:
            s.last_access = c.step.tick
        cfg, bs = c.config, c.block_size
        T = c.seqs.num_tokens(seq)
        kb, vb = self.read_blocks(layer, idx)  # (nb, H, bs, D) each
        nb = kb.shape[0]
        k = kb.transpose(0, 1).reshape(cfg.num_kv_heads, nb * bs, cfg.head_dim)[:, :T]  # (H, T, D)
        v = vb.transpose(0, 1).reshape(cfg.num_kv_heads, nb * bs, cfg.head_dim)[:, :T]  # (H, T, D)
        return k, v

    # ---- what was read ----
    def sample_reads(self, seqs: Sequence[Any]) -> list[list[int]] | None:
        c = self.cache
        if not (c.bus.enabled and c.digests.mode == "sample"):
            return None
        return [c.digests.sample((s := c.seqs.require(seq)).blocks, s) for seq in seqs]

    def emit_read(self, seq: Any, blocks: Sequence[int] | None = None, layer: int | None = None, *,
                  versions: Sequence[int] | None = None, tiers: Sequence[str] | None = None,
                  checked: Sequence[tuple[int, int]] | None = None) -> None:
        c = self.cache
        if not c.bus.enabled:
            return
        s = c.seqs.require(seq)
        if blocks is None:
            read = s.blocks
            ids = [b.id for b in read]
            versions = [b.version for b in read]
        else:
            ids = list(blocks)
            read = [c.pool.blocks.get(i) for i in ids]
            versions = list(versions) if versions is not None else [b.version if b is not None else -1 for b in read]
        digests = layers = None
        if checked is None:  # nobody digested the read's bytes as it read them: a pass over the picks now
            chosen = [i for i in c.digests.sample(read, s) if read[i] is not None]
            got, bad = c.mover.verify([read[i] for i in chosen]) if chosen else ([], [])
        else:  # the reader's digests stand where they are the records'; a mismatch is looked at again for its layer
            chosen, got = [i for i, _ in checked], [d for _, d in checked]
            bad = [None] * len(chosen)
            again = [k for k, (i, d) in enumerate(checked) if not self._confirms(read[i], d)]
            if again:
                redone = c.mover.verify([read[chosen[k]] for k in again])
                for k, d, lay in zip(again, *redone):
                    got[k], bad[k] = d, lay
        if chosen:
            digests, layers = [None] * len(ids), [None] * len(ids)
            for i, d, lay in zip(chosen, got, bad):
                digests[i], layers[i] = d, lay
            if not any(lay is not None for lay in layers):
                layers = None
        c.bus.emit(Read, seq=seq, blocks=ids, versions=versions, layer=layer, digests=digests, digest_layers=layers,
                   tiers=list(tiers) if tiers is not None else None)

    def _confirms(self, b: Block, digest: int | None) -> bool:
        """Whether ``digest``, taken by a reader over ``b``'s bytes, is its record's: the reader's digest stands.
        Otherwise (no record, a mismatch) ``mover.verify`` looks again, and names the first layer that differs."""
        rec = b.digest
        return rec is not None and rec.codec == b.codec and digest == self.cache.digests.recorded(rec)
