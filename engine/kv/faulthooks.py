"""Where the cache's named faults (``engine.faults``) strike: the bytes, slots or prefix blocks go wrong
while the events stay right, so each check can be shown catching its fault on the real engine.

Every hook is called from the one place in the cache's write or sequence path the fault belongs
to, and only while that fault is on; with no fault on none of this runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...events import PREFIX_CACHE, Evict
from ..config import Tier
from .pool import Block
from .sequences import SeqState

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["FaultHooks"]


class FaultHooks:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.stale_bytes: tuple[Block, torch.Tensor] | None = None  # stale-slot: the bytes a write must not replace

    def raw(self, b: Block) -> torch.Tensor:
        """``(L, H, R)`` view of a device block's stored row, in its arena's dtype."""
        arena, local = self.cache.devs.at(b.slot)
        return arena.view(local, 1)[0]

    # ---- content faults: the bytes go wrong ----
    def stale_slot(self, b: Block, seq: Any) -> None:
        """stale-slot: a block given a slot some earlier block used keeps that block's bytes (restored at commit)."""
        f, step = self.cache.faults, self.cache.bus.step
        used = f.used_slots
        if b.slot in used and f.content_due(step):
            f.fired(b.id, seq, None, step)
            self.stale_bytes = (b, self.raw(b).clone())
        used.add(b.slot)

    def row_off_by_one(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """row-off-by-one: the step's first token that is not its block's last row lands one row further."""
        c = self.cache
        f, step, bs = c.faults, c.bus.step, c.block_size
        if layer == 0 and f.content_due(step):
            inner = ((slots % bs) < bs - 1).nonzero()
            if inner.numel():
                i = int(inner[0, 0])
                b, seq = next(((b, q) for q in c.step.reserved for b, _, _ in c.seqs[q].writes
                               if b.slot == int(slots[i]) // bs), (None, None))
                if b is not None:
                    f.fired(b.id, seq, None, step)
                    f.shift = (int(slots[i]), step)
        shift = f.shift
        if shift is None or shift[1] != step:
            return slots
        moved = slots.clone()
        moved[slots == shift[0]] += 1
        return moved

    def nonfinite_write(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """nonfinite-write: the keys ``k`` (N, H, D) a store writes at ``slots``, the first token's first key element
        NaN at the fault's layer once (a copy: the caller's tensor stays as the model computed it)."""
        c = self.cache
        f, step, bs = c.faults, c.bus.step, c.block_size
        if layer != f.corrupt_layer or not f.nonfinite_due(step) or not slots.numel():
            return k
        flat = int(slots[0])
        b, seq, pos = next(((b, q, p + flat % bs - p % bs) for q in c.step.reserved for b, p, _ in c.seqs[q].writes
                            if b.slot == flat // bs), (None, None, None))
        if b is None:
            return k
        f.fired(b.id, seq, layer, step)
        f.hit["pos"] = pos
        k = k.clone()
        k[0, 0, 0] = float("nan")
        return k

    def corrupt_after_write(self, s: SeqState) -> None:
        """The content faults that strike right after ``s``'s write (see ``engine.faults``)."""
        c = self.cache
        f, step = c.faults, c.bus.step
        stale = self.stale_bytes
        if stale is not None and any(b is stale[0] for b, _, _ in s.writes):
            self.raw(stale[0]).copy_(stale[1])  # the write never landed: the previous block's bytes stay
            self.stale_bytes = None
        if not f.content_due(step) or not s.writes:
            return
        first, layer = s.blocks[0], f.corrupt_layer
        if f.content == "overwrite-foreign":
            other = next((q.blocks[-1] for q in c.seqs.values() if q is not s and q.blocks
                          and q.blocks[-1].tier == Tier.DEVICE and q.blocks[-1].codec == first.codec
                          and q.blocks[-1] not in s.blocks), None)
            if other is None or first.tier != Tier.DEVICE:
                return
            self.raw(first).copy_(self.raw(other))
            f.fired(first.id, s.id, None, step)
        elif f.content == "wrong-scale":
            b, pos, _ = s.writes[-1]
            codec = c.codecs[b.codec]
            if codec.native:
                return
            codec.scales(self.raw(b)[layer])[:, pos % c.block_size] *= 2  # (H, width) of the token
            f.fired(b.id, s.id, layer, step)
        elif first.tier != Tier.DEVICE:
            return
        elif f.content == "bit-flip":
            row = self.raw(first)[layer, 0].view(torch.uint8)  # (R bytes) of head 0
            row[self.raw(first).element_size() - 1] ^= 0x40  # a high bit of element 0: exponent, or a code bit
            f.fired(first.id, s.id, layer, step)
        elif f.content == "zeroed-block":
            self.raw(first)[layer].zero_()  # (H, R) of the layer: codes and scales alike
            f.fired(first.id, s.id, layer, step)
        elif f.content == "noise":
            row = self.raw(first)[layer]  # (H, R) in the arena's dtype
            keys = row[:, : c.block_size * c.config.head_dim]  # each head's K come first (codecs' layout)
            if keys.dtype.is_floating_point:
                gen = torch.Generator(device=keys.device).manual_seed(step)
                keys += 0.01 * keys.abs().mean() * torch.randn(keys.shape, generator=gen, device=keys.device).to(keys.dtype)
            else:  # codes: each one step up
                keys.view(torch.uint8).add_(1)
            f.fired(first.id, s.id, layer, step)

    # ---- placement faults: the slots go wrong ----
    def misaligned_target(self, seq: Any, n: int) -> Block | None:
        """batch-misalign: the second row of a step writes into the first row's tail block."""
        c = self.cache
        reserved = c.step.reserved
        if n != 1 or len(reserved) < 2 or reserved[1] != seq:
            return None
        first = c.seqs.get(reserved[0])
        if first is None or not first.blocks or first.blocks[-1].tier != Tier.DEVICE:
            return None
        return first.blocks[-1] if c.faults.misalign_now(c.bus.step) else None

    # ---- prefix-cache faults ----
    def reuse_cached_block(self, seq: Any, index: int) -> Block | None:
        """prefix-overwritten: an idle cached block handed out as ``seq``'s new block, still in the cache."""
        c = self.cache
        idle = c.prefix.idle(Tier.DEVICE) if c.prefix is not None else []
        if not idle:
            return None
        b = min(idle, key=lambda b: b.id)  # the faulty allocator takes blocks lowest id first, cached or not
        c.pool.share(b, seq)
        b.index, b.checksum, b.last_access = index, None, c.step.tick
        c.faults.fired(b.id, seq, None, c.bus.step)
        return b

    def drop_cached_under_readers(self, s: SeqState) -> None:
        """prefix-freed-in-use: the blocks ``s`` registered are evicted as it ends, whoever still holds them."""
        c = self.cache
        for b in s.blocks:
            if c.prefix.registered_by(b) != s.id or c.pool.blocks.get(b.id) is not b:
                continue
            if b.inflight is not None:
                c.mover.settle(b)
            c.prefix.forget(b)
            if any(o in c.seqs for o in b.owners):
                c.faults.fired(b.id, next(o for o in b.owners if o in c.seqs), None, c.bus.step)
            if c.bus.enabled:
                c.bus.emit(Evict, block=b.id, tier=b.tier, reason=PREFIX_CACHE)
            c.pool.drop(b)
