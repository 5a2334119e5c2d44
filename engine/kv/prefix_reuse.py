"""The cache's side of automatic prefix caching (``engine.kv.prefix``): a new sequence starting from cached
blocks, and the room the prefix cache's idle blocks give back when a tier is full.

``PrefixCache`` keys and finds blocks; this part hands them to a sequence and takes them back from
the pool, so keeping a cached block never pushes a request's block down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ...events import PREFIX_CACHE

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["PrefixReuse"]


class PrefixReuse:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def reclaim(self, tier: str, need: int, exclude: set[int]) -> None:
        """Room in ``tier`` from the prefix cache first: its least recently used blocks that no request holds
        move one tier down while that tier has free slots, and are evicted (reason ``prefix-cache``) past
        that, so keeping a cached block never pushes a request's block down."""
        c = self.cache
        if c.prefix is None or need <= 0:
            return
        victims = c.prefix.idle(tier, exclude)[:need]
        if not victims:
            return
        nxt = c.mover.slower(tier)
        room = c.pool.slots[nxt].num_free if nxt is not None else 0
        if room:
            c.mover.move(victims[:room], nxt)
        if victims[room:]:
            c.seqs.evict(victims[room:], tier, reason=PREFIX_CACHE)

    def reclaimable(self, tier: str) -> int:
        """Slots of ``tier`` the prefix cache gives up when room is needed (its blocks no request holds)."""
        prefix = self.cache.prefix
        return len(prefix.idle(tier)) if prefix is not None else 0

    def reuse(self, seq: Any, tokens: Sequence[int]) -> int:
        """Start ``seq`` (empty, just added) from the longest cached prefix of ``tokens``: the cached blocks
        become its first blocks (a ``share`` with the content key each). Returns the tokens served, which
        ``seq`` need not compute; 0 without a prefix cache."""
        c = self.cache
        s = c.seqs.require(seq)
        if c.prefix is None:
            return 0
        if s.length or s.pending or s.blocks:
            raise ValueError(f"reuse_prefix for {seq!r}: it already holds {s.length + s.pending} tokens")
        hits = c.prefix.lookup(seq, tokens)
        if hits:
            c.step.tick += 1
            c.step.pinned.add(seq)  # its hits stay where they are until the step that computes the rest
            for b in hits:
                b.last_access = c.step.tick
            s.blocks = list(hits)
            s.length = len(hits) * c.block_size
            s.last_access = c.step.tick
            s.index_cache = None
        return s.length
