"""Mixed resolution: device blocks held in several codecs, and the demotion that puts them there.

Each block carries its codec (``Block.codec``) and lives in its tier's arena of that codec
(``storage.TierArenas``). Device blocks of other codecs than the device's own (swapped back up from a
lossier tier, or demoted here) are stored and read one arena at a time, each block with its own
codec; while every device block is in the device's own arena the cache never comes here.

Under ``codec="mixed"`` a block that leaves its sequence's recent window, is not a sink and is not
among the blocks with the most attention mass is re-encoded in place to ``mixed_low`` at commit (a
``recode`` event), and never promoted back: precision never goes back up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from ...events import Recode
from ..config import Tier
from .codecs import PRECISION
from .pool import Block
from .sequences import SeqState

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["MixedResolution"]


class MixedResolution:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.num_recodes = 0  # blocks re-encoded in place (demotions)

    # ---- reading and writing blocks of several codecs ----
    def read(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``read_blocks`` over device slots in several codec arenas: one gather and decode per arena."""
        cache = self.cache
        c, devs, used_by = cache.config, cache.devs, cache.pool.slots[Tier.DEVICE].used_by
        flat = slots.reshape(-1)
        where, local = flat >> devs.shift, flat & devs.mask
        H = 1 if heads is not None else c.num_kv_heads
        shape = (flat.numel(), H, cache.block_size, c.head_dim)
        k = torch.zeros(shape, dtype=c.compute_dtype, device=cache.device)  # (n, H, bs, D)
        v = torch.zeros(shape, dtype=c.compute_dtype, device=cache.device)
        flat_heads = heads.reshape(-1) if heads is not None else None
        for i, arena in enumerate(devs.arenas):
            if arena is None or (i and not used_by[i]):
                continue
            sel = (where == i).nonzero().squeeze(1)
            if not sel.numel() or not arena.num_slots:  # an empty own arena: only padding points there
                continue
            codec = cache.codecs[arena.codec]
            if flat_heads is None:
                rows = arena.data[:, layer].index_select(0, local[sel])  # (m, H, R)
                k[sel], v[sel] = codec.read(rows, layer)
            else:
                h = flat_heads[sel]
                rows = arena.data[:, layer][local[sel], h]  # (m, R)
                k[sel], v[sel] = codec.read(rows[:, None], layer, h)
        if heads is not None:
            return k.view(*slots.shape, *shape[2:]), v.view(*slots.shape, *shape[2:])
        return k.view(*slots.shape, *shape[1:]), v.view(*slots.shape, *shape[1:])

    def store(self, layer: int, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              meant: torch.Tensor | None) -> None:
        """``store`` when the device holds blocks in several codecs: each token encoded by its block's."""
        cache, devs = self.cache, self.cache.devs
        where = blk >> devs.shift
        for i in where.unique().tolist():
            sel = (where == i).nonzero().squeeze(1)
            arena = devs.get(i)
            local = blk[sel] & devs.mask
            parts = cache.codecs[arena.codec].write(arena.data[:, layer], layer, local, off[sel], k[sel], v[sel])
            if meant is not None:
                cache.writes.stage((id(meant), i), layer, arena.codec, meant[sel], parts, devs.slot(i, 0))

    # ---- demotion ----
    def demote_unimportant(self, s: SeqState) -> None:
        """Re-encode to ``mixed_low`` the device blocks of ``s`` that left its recent window, are not sinks,
        and are not among the ``keep`` with the most attention mass."""
        c = self.cache.config
        old = s.blocks[: max(len(s.blocks) - c.mixed_window, 0)]
        high = self.cache.codec.name
        cands = [b for b in old if b.codec == high and b.index >= c.sink_blocks]
        keep = max(c.mixed_high_blocks, int(c.mixed_high_fraction * len(s.blocks)))
        if len(cands) <= keep:
            return
        cands = [b for b in cands if b.tier == Tier.DEVICE and b.inflight is None and not self._in_a_window(b)]
        cands.sort(key=self.cache.importance.of, reverse=True)  # stable: among equals, the older blocks stay high
        if len(cands) > keep:
            self.cache.recode([b.id for b in cands[keep:]], c.mixed_low)  # the cache's own entry: one to watch

    def _in_a_window(self, b: Block) -> bool:
        """A shared block stays high while it is in any owner's recent window."""
        w, seqs = self.cache.config.mixed_window, self.cache.seqs
        return len(b.owners) > 1 and any(b in seqs[o].blocks[-w:] for o in b.owners if o in seqs)

    def recode(self, blocks: Iterable[int], codec: str) -> None:
        """Re-encode device blocks in place to the lossier ``codec`` (a ``recode`` event each; the version
        stays). A block already at least as lossy is left as it is: precision never goes back up."""
        cache = self.cache
        devs, mover, bus = cache.devs, cache.mover, cache.bus
        if codec not in devs.codecs:
            raise ValueError(f"recode to {codec!r}: the device holds {', '.join(devs.codecs)}")
        todo: dict[str, list[Block]] = {}
        for b in cache.pool.lookup(blocks):
            if b.tier != Tier.DEVICE or b.inflight is not None:
                raise ValueError(f"recode of block {b.id}: it is not settled on the device (tier {b.tier})")
            if PRECISION[codec] > PRECISION[b.codec]:
                todo.setdefault(b.codec, []).append(b)
        index = devs.index(codec)
        for src, group in todo.items():
            slots = mover.take(Tier.DEVICE, [index] * len(group))
            before, bad = mover.verify(group)  # the bytes about to be re-encoded, against their record
            sums = mover.recode(Tier.DEVICE, [b.slot for b in group], src, Tier.DEVICE, slots, codec)
            for b, slot, c in zip(group, slots, sums):
                b.codec, b.checksum = codec, c
                cache.pool.move(b, Tier.DEVICE, slot)  # the high slot goes back to its arena's free list
                self.num_recodes += 1
            after = mover.retake(group)
            if bus.enabled:
                for b, d, layer, new in zip(group, before, bad, after):
                    bus.emit(Recode, block=b.id, tier=Tier.DEVICE, src_codec=src, dst_codec=codec,
                              version=b.version, digest=d, digest_layer=layer, new_digest=new)
