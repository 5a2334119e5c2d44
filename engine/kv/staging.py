"""The device staging area: a bounded buffer through which attention reads blocks that sit on a slower tier.

Long context (``EngineConfig.staging_blocks``) lets a sequence outgrow the device. Attention reads a
host or disk block by copying one layer's rows of it into a staging slot on the device and decoding them
there; the area holds ``staging_blocks`` blocks (all layers' room, in the block's codec), so the device
never needs more than it plus the pinned sinks and recent window, however long the sequence.

A staged copy stays until its slot is needed again (least recently used first, per layer), and a later read
of the same copy, block, tier slot and version, at that layer, is served from it without moving a byte:
block-sparse top-k reads the same pages step after step, and those become device reads. Every copy remembers the
version it was staged at, and that is the version a ``read`` event reports, so a copy older than the
block's last write is a ``stale-read`` for the checks. The ``stale-staging`` fault reuses a copy by the block's
id alone, without comparing versions: the bug a staging cache keyed by block id has.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..config import EngineConfig
from .codecs import Codec
from .readplan import BlockLoc
from .storage import TierArenas

__all__ = ["StagingArea", "StagedStep"]


@dataclass
class StagedStep:
    """What the staging area did in one step, for the ``stage`` events and the byte counts."""

    copies: dict[Any, dict[int, tuple[str, int]]] = field(default_factory=dict)  # seq -> block -> (src tier, version)
    bytes_moved: int = 0  # rows copied into the area
    bytes_by_seq: dict[Any, int] = field(default_factory=dict)
    rows_staged: int = 0  # (layer, block) rows copied
    rows_reused: int = 0  # (layer, block) rows served from a copy already staged


class _Buffer:
    """Staging slots of one codec: ``(L, capacity, H, R)`` on the device, and per layer who holds each slot.

    Each layer has its own ``capacity`` slots and its own least-recently-used order: attention reads a layer at
    a time, and top-k chooses its pages per layer, so a layer keeps its own picks staged whatever the others read.
    """

    def __init__(self, config: EngineConfig, codec: str, device: torch.device) -> None:
        layout = config.layout(codec)
        self.data = torch.zeros((config.num_layers, config.staging_blocks, config.num_kv_heads, layout.row_elems),
                                dtype=layout.torch_dtype, device=device)
        self.row_bytes = layout.row_bytes * config.num_kv_heads  # one layer of one block
        # per layer: copy key -> (slot, version staged), least recently used first
        self.held: list[OrderedDict[tuple, tuple[int, int]]] = [OrderedDict() for _ in range(config.num_layers)]
        self.free: list[list[int]] = [list(range(config.staging_blocks - 1, -1, -1)) for _ in range(config.num_layers)]


class StagingArea:
    """``load`` one layer of a chunk of slower-tier blocks onto the device, decoded; see the module docstring."""

    def __init__(self, config: EngineConfig, tier_arenas: dict[str, TierArenas], codecs: dict[str, Codec],
                 device: torch.device, *, by_id: bool = False) -> None:
        if config.staging_blocks < 1:
            raise ValueError("a staging area needs staging_blocks >= 1")
        self.config, self.tier_arenas, self.codecs, self.device = config, tier_arenas, codecs, device
        self.capacity = config.staging_blocks
        self.by_id = by_id  # the stale-staging fault: a copy is found by block id, whatever its version
        self._buffers: dict[str, _Buffer] = {}
        self.step = StagedStep()

    def _buffer(self, codec: str) -> _Buffer:
        buf = self._buffers.get(codec)
        if buf is None:
            buf = self._buffers[codec] = _Buffer(self.config, codec, self.device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.data.numel() * b.data.element_size() for b in self._buffers.values())

    def _key(self, loc: BlockLoc) -> tuple:
        return (loc.block,) if self.by_id else (loc.block, loc.index, loc.tier, loc.slot)

    def load(self, layer: int, seq: Any, locs: tuple[BlockLoc, ...]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """K and V of ``locs`` (at most ``capacity`` blocks) at ``layer``, each ``(n, H_kv, bs, D)`` in the compute
        dtype, and the version of the copy each was read from."""
        if len(locs) > self.capacity:
            raise ValueError(f"{len(locs)} blocks to stage at once; the staging area holds {self.capacity}")
        c = self.config
        versions = [0] * len(locs)
        codec0 = locs[0].codec if locs else c.codec
        if all(loc.codec == codec0 for loc in locs):  # one codec (the usual case): already in the order asked
            rows = self._place(self._buffer(codec0), layer, seq, locs, versions, range(len(locs)))
            k, v = self.codecs[codec0].read(rows, layer)  # (n, H, bs, D) each
            return k, v, versions
        by_codec: dict[str, list[int]] = {}
        for i, loc in enumerate(locs):
            by_codec.setdefault(loc.codec, []).append(i)
        k = torch.empty((len(locs), c.num_kv_heads, c.block_size, c.head_dim), dtype=c.compute_dtype, device=self.device)
        v = torch.empty_like(k)
        for codec, idx in by_codec.items():
            rows = self._place(self._buffer(codec), layer, seq, [locs[i] for i in idx], versions, idx)
            sel = torch.tensor(idx, device=self.device)
            k[sel], v[sel] = self.codecs[codec].read(rows, layer)
        return k, v, versions

    def _place(self, buf: _Buffer, layer: int, seq: Any, locs: Sequence[BlockLoc], versions: list[int],
               idx: Sequence[int]) -> torch.Tensor:
        """The staged rows ``(n, H, R)`` of ``locs`` at ``layer``, copying into the area the ones not there yet.

        The bookkeeping is per chunk, not per block: the copies still valid are found first and touched, then
        the missing ones take free slots or the least recently used ones (never one this call reads: those were
        just moved to the back), and every missing row of one tier arena comes over in one gather and one copy."""
        held, step = buf.held[layer], self.step
        slots = [0] * len(locs)
        missing: list[int] = []
        for j, loc in enumerate(locs):
            key = self._key(loc)
            ent = held.get(key)
            if ent is not None and (self.by_id or ent[1] == loc.version):
                held.move_to_end(key)
                slots[j] = ent[0]
                versions[idx[j]] = ent[1]  # the copy read is the one staged, at the version it was staged at
            else:
                missing.append(j)
        step.rows_reused += len(locs) - len(missing)
        if not missing:
            return buf.data[layer].index_select(0, torch.tensor(slots, device=self.device))
        free = buf.free[layer]
        todo: dict[tuple[str, int], list[int]] = {}  # (tier, arena) -> positions in locs
        copies = step.copies.setdefault(seq, {})
        for j in missing:
            loc = locs[j]
            key = self._key(loc)
            old = held.pop(key, None)  # an older version of the same copy: its slot is rewritten
            slot = old[0] if old is not None else free.pop() if free else held.popitem(last=False)[1][0]
            held[key] = (slot, loc.version)
            slots[j] = slot
            versions[idx[j]] = loc.version
            copies[loc.block] = (loc.tier, loc.version)
            shift = self.tier_arenas[loc.tier].shift
            todo.setdefault((loc.tier, loc.slot >> shift), []).append(j)
        layer_data = buf.data[layer]  # (capacity, H, R)
        fresh = None
        for (tier, arena), js in todo.items():
            mask = self.tier_arenas[tier].mask
            rows = self.tier_arenas[tier].get(arena).layer_rows(layer, [locs[j].slot & mask for j in js])  # (m, H, R)
            rows = rows.to(self.device, non_blocking=True)
            layer_data.index_copy_(0, torch.tensor([slots[j] for j in js], device=self.device), rows)
            fresh = rows
        moved = len(missing) * buf.row_bytes
        step.rows_staged += len(missing)
        step.bytes_moved += moved
        step.bytes_by_seq[seq] = step.bytes_by_seq.get(seq, 0) + moved
        if len(missing) == len(locs) and len(todo) == 1:  # every row just came over, in the order asked
            return fresh
        return layer_data.index_select(0, torch.tensor(slots, device=self.device))

    def end_step(self) -> StagedStep:
        """This step's record, and a fresh one for the next."""
        done, self.step = self.step, StagedStep()
        return done
