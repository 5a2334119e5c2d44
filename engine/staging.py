"""The device staging area: a bounded buffer through which attention reads blocks that sit on a slower tier.

Long context (``EngineConfig.staging_blocks``) lets a sequence outgrow the device. Attention reads a
host or disk block by copying one layer's rows of it into a staging slot on the device and decoding them
there; the area holds ``staging_blocks`` blocks (all layers' room, in the block's codec), so the device
never needs more than it plus the pinned sinks and recent window, however long the sequence.

A staged copy stays until its slot is needed again (least recently used first), and a later read of the
same copy, block, tier slot and version, layer by layer, is served from it without moving a byte: block-sparse
top-k reads the same pages step after step, and those become device reads. Every copy remembers the
version it was staged at, and that is the version a ``read`` event reports, so a copy older than the
block's last write is a ``stale-read`` for the checks. The ``stale-staging`` fault reuses a copy by the block's
id alone, without comparing versions: the bug a staging cache keyed by block id has.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .codecs import Codec
from .config import EngineConfig
from .readplan import BlockLoc
from .storage import TierArenas

__all__ = ["StagingArea", "StagedStep"]

_EMPTY = -1  # a layer of a staging slot that holds no rows


@dataclass
class StagedStep:
    """What the staging area did in one step, for the ``stage`` events and the byte counts."""

    copies: dict[Any, dict[int, tuple[str, int]]] = field(default_factory=dict)  # seq -> block -> (src tier, version)
    bytes_moved: int = 0  # rows copied into the area
    bytes_by_seq: dict[Any, int] = field(default_factory=dict)
    rows_staged: int = 0  # (layer, block) rows copied
    rows_reused: int = 0  # (layer, block) rows served from a copy already staged


class _Buffer:
    """Staging slots of one codec: ``(capacity, L, H, R)`` on the device and who each holds."""

    def __init__(self, config: EngineConfig, codec: str, device: torch.device) -> None:
        layout = config.layout(codec)
        self.data = torch.zeros((config.staging_blocks, config.num_layers, config.num_kv_heads, layout.row_elems),
                                dtype=layout.torch_dtype, device=device)
        self.row_bytes = layout.row_bytes * config.num_kv_heads  # one layer of one block
        self.keys: OrderedDict[tuple, int] = OrderedDict()  # copy key -> slot, least recently used first
        self.holder: list[tuple | None] = [None] * config.staging_blocks
        self.versions = [[_EMPTY] * config.num_layers for _ in range(config.staging_blocks)]


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
        by_codec: dict[str, list[int]] = {}
        for i, loc in enumerate(locs):
            by_codec.setdefault(loc.codec, []).append(i)
        parts = []
        for codec, idx in by_codec.items():
            buf = self._buffer(codec)
            slots = self._place(buf, layer, seq, [locs[i] for i in idx], versions, idx)
            rows = buf.data[torch.tensor(slots, device=self.device), layer]  # (m, H, R)
            parts.append((idx, *self.codecs[codec].read(rows, layer)))  # (m, H, bs, D) each
        if len(parts) == 1:  # one codec (the usual case): already in the order asked
            return parts[0][1], parts[0][2], versions
        k = torch.empty((len(locs), c.num_kv_heads, c.block_size, c.head_dim), dtype=c.compute_dtype, device=self.device)
        v = torch.empty_like(k)
        for idx, ki, vi in parts:
            sel = torch.tensor(idx, device=self.device)
            k[sel], v[sel] = ki, vi
        return k, v, versions

    def _place(self, buf: _Buffer, layer: int, seq: Any, locs: list[BlockLoc], versions: list[int],
               idx: list[int]) -> list[int]:
        """The staging slot of each loc at ``layer``, copying the rows that are not there yet."""
        slots: list[int] = []
        busy: set[int] = set()  # slots this call uses: never reclaimed for another of its blocks
        todo: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (tier, arena) -> [(staging slot, local slot)]
        step = self.step
        for i, loc in zip(idx, locs):
            key = self._key(loc)
            slot = buf.keys.get(key)
            held = buf.versions[slot][layer] if slot is not None else _EMPTY
            if slot is not None and held != _EMPTY and (self.by_id or held == loc.version):
                buf.keys.move_to_end(key)
                versions[i] = held  # the copy read is the one staged, at the version it was staged at
                step.rows_reused += 1
            else:
                if slot is None:
                    slot = self._claim(buf, key, busy)
                elif held != loc.version and held != _EMPTY:
                    buf.versions[slot] = [_EMPTY] * self.config.num_layers  # the block changed: every layer is old
                buf.keys.move_to_end(key)
                arenas = self.tier_arenas[loc.tier]
                todo.setdefault((loc.tier, loc.slot >> arenas.shift), []).append((slot, loc.slot & arenas.mask))
                buf.versions[slot][layer] = loc.version
                versions[i] = loc.version
                step.copies.setdefault(seq, {})[loc.block] = (loc.tier, loc.version)
            busy.add(slot)
            slots.append(slot)
        for (tier, arena), pairs in todo.items():
            rows = self.tier_arenas[tier].get(arena).layer_rows(layer, [s for _, s in pairs])  # (m, H, R)
            dst = torch.tensor([d for d, _ in pairs], device=self.device)
            buf.data[dst, layer] = rows.to(self.device, non_blocking=True)
            step.rows_staged += len(pairs)
            step.bytes_moved += len(pairs) * buf.row_bytes
            step.bytes_by_seq[seq] = step.bytes_by_seq.get(seq, 0) + len(pairs) * buf.row_bytes
        return slots

    def _claim(self, buf: _Buffer, key: tuple, busy: set[int]) -> int:
        """A slot for a new copy: a free one, else the least recently used one this call does not need."""
        try:
            slot = buf.holder.index(None)
        except ValueError:
            old = next(k for k, s in buf.keys.items() if s not in busy)
            slot = buf.keys.pop(old)
        buf.holder[slot] = key
        buf.keys[key] = slot
        buf.versions[slot] = [_EMPTY] * self.config.num_layers
        return slot

    def end_step(self) -> StagedStep:
        """This step's record, and a fresh one for the next."""
        done, self.step = self.step, StagedStep()
        return done
