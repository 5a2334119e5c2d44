"""The cache's write path: ``reserve`` slots for a sequence's next tokens, ``store`` every layer's K/V into
them, ``commit`` once all layers are stored.

``reserve`` allocates the blocks the new positions need (demoting other sequences' blocks when the
device is full), brings the block being appended to back to the device and gives the sequence its own
copy of it when it is shared. ``commit`` advances the version by the tokens written and emits a
``write`` per block touched: every write advances the version, so a stale copy shows up as an older one.
A write whose stored K or V holds a NaN or an Inf says so, with its positions, first layer and writer
(``engine.kv.nonfinite``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ... import callsite
from ...events import Write
from ..config import Tier
from .nonfinite import NonFiniteScan
from .pool import Block
from .sequences import SeqState

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["Writes"]


class Writes:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.nonfinite = NonFiniteScan(cache)

    def reserve(self, seq: Any, n: int) -> torch.Tensor:
        c = self.cache
        s = c.seqs.require(seq)
        if n < 0:
            raise ValueError(f"reserve of {n} tokens for {seq!r}: must be >= 0")
        bs, step = c.block_size, c.step
        step.tick += 1
        s.last_access = step.tick
        step.pinned.add(seq)
        if seq not in step.reserved:
            step.reserved.append(seq)
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=c.device)
        start = s.length + s.pending
        end = start + n
        last = s.blocks[-1] if s.blocks else None
        tail = last if last is not None and last.index == start // bs else None
        if tail is not None and tail.inflight is not None:
            c.mover.settle(tail)  # a prefetch already holds its device slot: land it rather than ask for another
        cow = tail is not None and len(tail.owners) > 1
        first_new = (last.index + 1) if last is not None else 0
        num_new = max((end - 1) // bs + 1 - first_new, 0)
        need = num_new + int(cow) + int(tail is not None and tail.tier != Tier.DEVICE)
        keep = c.longctx.hold(s, tail) if c.staging is not None else None
        if need:  # the sequence's own blocks are never the room made for it
            keep = keep if keep is not None else {b.id for b in s.blocks}
            c.mover.make_room(Tier.DEVICE, need, keep)
        if tail is not None:
            if tail.tier != Tier.DEVICE:
                c.mover.move([tail], Tier.DEVICE, exclude=keep)
            if cow:
                tail = self._copy_on_write(s, tail)
            tail.checksum = None  # its bytes are about to change
        hooks = c.fault_hooks
        for i in range(first_new, first_new + num_new):
            reused = hooks.reuse_cached_block(seq, i) if c.faults.prefix_overwritten else None
            if reused is None:
                reused = c.pool.alloc(Tier.DEVICE, seq, i)
                # A fresh block holds what its slot's last owner left. Unless this reservation writes all of it,
                # it is zeroed: the slots a read hides past the row's keys stay finite (0 x NaN is NaN).
                if not start <= i * bs <= end - bs:
                    dst, d = c.devs.at(reused.slot)
                    dst.view(d, 1).zero_()
            s.blocks.append(reused)
            step.held.add(s.blocks[-1].id)
            if c.faults.content == "stale-slot":
                hooks.stale_slot(s.blocks[-1], seq)
        if num_new or cow:  # its block table changed (a moved block changes the pool's epoch instead)
            s.index_cache = None
        writes: list[tuple[Block, int, int]] = []
        slots: list[int] = []
        by_index = {b.index: b for b in s.blocks[-(num_new + 1):]}
        misaligned = hooks.misaligned_target(seq, n) if c.faults.batch_misalign else None
        pos = start
        while pos < end:
            b = misaligned or by_index[pos // bs]
            m = min(end, (pos // bs + 1) * bs) - pos
            off = pos % bs
            slots.extend(range(b.slot * bs + off, b.slot * bs + off + m))
            writes.append((b, pos, m))
            b.last_access = step.tick
            pos += m
        s.writes.extend(writes)
        s.pending += n
        return torch.tensor(slots, dtype=torch.long, device=c.device)

    def _copy_on_write(self, s: SeqState, shared: Block) -> Block:
        """Give ``s`` a private copy of the shared block it is about to append to."""
        c = self.cache
        own = c.pool.alloc(Tier.DEVICE, s.id, shared.index, shared.codec)
        dst, d = c.devs.at(own.slot)
        src, s_ = c.devs.at(shared.slot)
        dst.view(d, 1).copy_(src.view(s_, 1))
        own.version = shared.version
        own.digest = shared.digest.copy() if shared.digest is not None else None
        if shared.id in c.merged:
            c.merged[own.id] = c.merged[shared.id]
        own.last_access = c.step.tick
        s.blocks[-1] = own
        c.seqs.free_or_keep(shared, s.id, emit_release=True)
        return own

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        c = self.cache
        meant = slots
        if c.faults.row_off_by_one:
            slots = c.fault_hooks.row_off_by_one(layer, slots)
        if c.faults.nonfinite_write:
            k = c.fault_hooks.nonfinite_write(layer, slots, k)
        plan = c.layout.plan(slots)
        blk, off = plan.blk, plan.off
        digest = c.bus.enabled and c.digests.recording
        if not c.single_codec():  # some device blocks are in other codecs' arenas
            c.mixed.store(layer, blk, off, k, v, meant if digest else None)
            return
        if not c.codec.native:
            parts = c.codec.write(c.dev.data[:, layer], layer, blk, off, k, v)
            if digest:
                self.stage(id(meant), layer, c.codec.name, meant, parts, 0)
            return
        kv = c.layout.layer_kv(layer)  # (P, H, 2, bs, D)
        if plan.rows is not None:  # one copy of every head's K and V row into the arena as (rows, D)
            kv.as_strided((plan.extent, kv.shape[-1]), (kv.shape[-1], 1)).index_copy_(
                0, plan.rows, torch.stack((k, v)).to(kv.dtype).view(-1, kv.shape[-1]))
        else:
            kv[blk, :, 0, off] = k.to(kv.dtype)
            kv[blk, :, 1, off] = v.to(kv.dtype)
        if digest:
            c.digests.stage(id(meant), layer, c.codec.name, meant, (k, v))

    def stage(self, key: Any, layer: int, codec: str, meant: torch.Tensor, parts: dict[str, torch.Tensor],
              base: int) -> None:
        """Stage what ``codec.write`` stored; its key groups are numbered in the arena, ``base`` its first slot."""
        c = self.cache
        groups = parts.pop("groups", None)
        if groups is not None:
            groups = groups + base * c.codecs[codec].key_groups
        c.digests.stage(key, layer, codec, meant, parts, groups)

    def store_rows(self, slots: torch.Tensor) -> torch.Tensor | None:
        c = self.cache
        if (c.faults.row_off_by_one or c.faults.nonfinite_due(c.bus.step) or not c.codec.native
                or not c.single_codec()):
            return None
        return c.layout.plan(slots).rows

    def digest_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        c = self.cache
        if not (c.bus.enabled and c.digests.recording):
            return None
        return c.digests.weights(c.codec.name)

    def stored(self, slots: torch.Tensor, units: np.ndarray, shares: np.ndarray | None = None) -> None:
        c = self.cache
        if c.bus.enabled and c.digests.recording:
            c.digests.stage_units(id(slots), c.codec.name, slots, units, shares)

    def commit(self, seq: Any, n: int | None = None, tokens: Sequence[int] | None = None) -> None:
        c = self.cache
        s = c.seqs.require(seq)
        n = s.pending if n is None else n
        if not 0 <= n <= s.pending:
            raise ValueError(f"commit of {n} tokens for {seq!r}: must be in [0, {s.pending}] (reserved)")
        left = n
        bad = self.nonfinite.of(s) if c.bus.enabled else None
        for b, pos, m in s.writes:
            if left <= 0:
                break
            m = min(m, left)
            left -= m
            s.version += m  # every write advances the version, so a stale copy shows up as an older one
            b.version = s.version
            b.checksum = None
            digest = None
            if c.bus.enabled and c.digests.recording:
                digest = c.digests.record_write(b, pos, m)
            else:
                b.digest = None  # its bytes changed unrecorded: nothing to verify them against from now on
            if c.bus.enabled:
                at = b.slot * c.block_size - pos + pos % c.block_size  # flat slot of position p: at + p
                nan = {p: bad[at + p] for p in range(pos, pos + m) if at + p in bad} if bad else None
                c.bus.emit(Write, block=b.id, seq=seq, pos=pos, n=m, version=s.version, digest=digest,
                           nonfinite=sorted(nan) if nan else None, nonfinite_layer=min(nan.values()) if nan else None,
                           stack=callsite.user_stack() if nan else None)
        if c.faults.content is not None:
            c.fault_hooks.corrupt_after_write(s)
        s.length += n
        s.pending = 0
        s.writes = []
        if c.prefix is not None:
            c.prefix.committed(seq, s.blocks, tokens[:n] if tokens is not None else None)
        c.seqs.drop_tail(s, emit_release=True)
        if c.config.mixed:
            c.mixed.demote_unimportant(s)
