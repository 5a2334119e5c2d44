"""What the cache holds, counted: each tier's ``usage`` event at a step's end, the peak of resident KV bytes,
and ``stats()`` (occupancy per tier in blocks and in the real bytes of each block's codec, tokens,
prefetch and swaps).
"""

from __future__ import annotations

from operator import mul
from typing import TYPE_CHECKING, Any

from ...events import Usage

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["CacheStats"]


class CacheStats:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.peak_kv_bytes = 0  # the most KV bytes resident (every tier, each block in its codec) at a step's end
        layout = cache.config.layout
        # per tier, the bytes a block takes in each of its arenas (their codecs): a step's count is one product
        self._block_bytes = {t: [layout(name).bytes_per_block for name in a.codecs] for t, a in cache.tier_arenas.items()}

    def end_step(self) -> None:
        """Book the step's peak, and emit each tier's usage while someone listens."""
        c = self.cache
        slots = c.pool.slots
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(map(self.used_bytes, slots)))
        if not c.bus.enabled:
            return
        landing = {t: 0 for t in slots}  # slots held for prefetches still in flight
        landing_bytes = {t: 0 for t in slots}
        for b in c.mover.inflight.values():
            landing[b.inflight.dst] += 1
            landing_bytes[b.inflight.dst] += c.config.layout(b.codec).bytes_per_block
        for t, ts in slots.items():
            # blocks as the events place them: an in-flight copy counts where it comes from until it lands
            used = ts.used - landing[t]
            c.bus.emit(Usage, tier=t, used_blocks=used, capacity_blocks=ts.capacity,
                       bytes=self.used_bytes(t) - landing_bytes[t])

    def _blocks_by_codec(self, tier: str) -> dict[str, int]:
        ts = self.cache.pool.slots[tier]
        return {c: n for c, n in zip(self.cache.tier_arenas[tier].codecs, ts.used_by) if n}

    def used_bytes(self, tier: str) -> int:
        """Bytes the blocks in ``tier`` take, each in its own codec's layout (padding included)."""
        return sum(map(mul, self.cache.pool.slots[tier].used_by, self._block_bytes[tier]))

    def stats(self) -> dict[str, Any]:
        c = self.cache
        bs, layout = c.block_size, c.config.layout
        tiers = {}
        for t, ts in c.pool.slots.items():
            by_codec = self._blocks_by_codec(t)
            tiers[t] = {
                "capacity_blocks": ts.capacity, "used_blocks": ts.used, "free_blocks": ts.num_free,
                "used_bytes": self.used_bytes(t), "arena_bytes": c.tier_arenas[t].nbytes,
                "codec": c.config.tier_codec(t), "blocks_by_codec": by_codec,
                "bytes_by_codec": {name: n * layout(name).bytes_per_block for name, n in by_codec.items()},
            }
        held: dict[int, int] = {}  # block -> token slots in use (the longest owner's view of a shared block)
        for q in c.seqs.values():
            end = q.length + q.pending
            for b in q.blocks:
                held[b.id] = max(held.get(b.id, 0), min(bs, end - b.index * bs))
        tokens = sum(held.values())
        slots = len(c.pool.blocks) * bs
        mover = c.mover
        return {
            "tiers": tiers,
            "sequences": len(c.seqs),
            "blocks": len(c.pool.blocks),
            "tokens": tokens,
            "kv_bytes": sum(t["used_bytes"] for t in tiers.values()),  # resident in every tier, each block in its codec
            "peak_kv_bytes": self.peak_kv_bytes,
            "recodes": c.mixed.num_recodes,
            "fragmentation": (1 - tokens / slots) if slots else 0.0,  # empty slots in allocated blocks
            "prefetch_hits": mover.prefetch_hits,
            "prefetch_misses": mover.prefetch_misses,
            "prefetch_hit_rate": mover.hit_rate,
            "swaps": {f"{s}->{d}": int(n) for (s, d), (n, _) in mover.moved.items()},
            **({"prefix": c.prefix.stats()} if c.prefix is not None else {}),
        }
