"""The sequences table: each sequence's blocks, length and pending reservation, and the lifecycle
(start, fork, adopt, roll back, end) that keeps it and the pool's owner sets in step.

A sequence's ``blocks`` are the pool's ``Block`` objects in position order; the pool owns who
holds a block, this table owns which blocks a sequence reads. Every change here that gives a
block up goes through ``free_or_keep`` (freed when nobody else owns it) or ``evict`` (dropped
from every owner), so the two never disagree.

``StepState`` is what the current step uses: sequences used in it are pinned until the step
ends, so a slot handed out by ``reserve`` stays valid for the whole step.

``Held`` is what a scheduler asks of the sequences it runs, many at once (``held``), as vLLM's scheduler
asks its KV cache manager narrow questions rather than reading its block pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from ... import callsite
from ...events import Evict, Rollback, SeqEnd, SeqStart
from ..config import Tier
from ..errors import UnknownSequence
from .pool import Block

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["Held", "SeqState", "StepState", "SequenceTable"]


@dataclass(eq=False, slots=True)
class SeqState:
    id: Any
    prompt_len: int
    priority: int = 0
    blocks: list[Block] = field(default_factory=list)  # present blocks in position order (evicted ones leave gaps)
    length: int = 0  # committed tokens
    pending: int = 0  # reserved, stored, not yet committed
    version: int = 0
    writes: list[tuple[Block, int, int]] = field(default_factory=list)  # (block, pos, n) of the pending reservation
    last_access: int = 0
    index_cache: Any = None  # device tensor of the blocks' slots, rebuilt when the table or a slot changes
    reads: int = -1  # the verification sweep's credit (engine.kv.digest; -1 until the first read, which staggers it)


@dataclass(slots=True)
class StepState:
    """The cache's clock and what the current step holds on to (cleared by ``end_step``)."""

    long_context: bool
    tick: int = 0  # advances with every reserve, gather and ensure_resident: the policy's recency
    pinned: set[Any] = field(default_factory=set)  # sequences the current step uses
    reserved: list[Any] = field(default_factory=list)  # sequences in the order this step reserved them
    # long context: the blocks this step needs on the device (sinks, recent windows, blocks written); the
    # rest of a running sequence's blocks may be demoted, and attention streams them (engine.features.streaming)
    held: set[int] = field(default_factory=set)

    def protects(self, b: Block) -> bool:
        """Whether ``b`` must stay where it is this step (the tier mover never picks it as a victim)."""
        if self.long_context:  # long context: a running sequence needs only these on the device
            return b.id in self.held
        return any(o in self.pinned for o in b.owners)

    def clear(self) -> None:
        self.pinned.clear()
        self.reserved.clear()
        self.held.clear()


@dataclass(frozen=True, slots=True)
class Held:
    """What a sequence holds, as a scheduler plans a step by it."""

    length: int  # committed tokens
    on_device: int  # blocks on the device, or landing there (a prefetch in flight has taken its slot)
    away: bool  # some block is off the device or in flight: it must be brought back before the sequence runs


class SequenceTable(dict):
    """Sequence id -> ``SeqState``, with the operations that change which blocks a sequence holds."""

    def __init__(self, cache: PagedKVCache) -> None:
        super().__init__()
        self.cache = cache

    def require(self, seq: Any) -> SeqState:
        try:
            return self[seq]
        except KeyError:
            raise UnknownSequence(seq) from None

    # ---- lifecycle ----
    def add(self, seq: Any, prompt_len: int = 0, priority: int = 0, adapter: str | None = None) -> None:
        c = self.cache
        if seq in self:
            raise ValueError(f"sequence {seq!r} is already in the cache")
        self[seq] = SeqState(seq, prompt_len, priority)
        if c.bus.enabled:
            # the adapter is part of its K/V; the stack names the user's line that admitted it
            c.bus.emit(SeqStart, seq=seq, prompt_len=prompt_len, adapter=adapter, stack=callsite.user_stack())
        if c.prefix is not None:
            c.prefix.begin(seq, adapter)

    def remove(self, seq: Any, reason: str = "finished", error: str | None = None) -> None:
        c = self.cache
        s = self.require(seq)
        del self[seq]
        c.step.pinned.discard(seq)
        if c.bus.enabled:
            c.bus.emit(SeqEnd, seq=seq, reason=reason, error=error, stack=callsite.user_stack())  # who ended or aborted it
        if c.prefix is not None:
            if c.faults.prefix_freed_in_use:
                c.fault_hooks.drop_cached_under_readers(s)
            c.prefix.ended(seq)
        for b in reversed(s.blocks):
            if c.faults.leak_swapped and b.tier != Tier.DEVICE:
                continue  # the fault: a block away from the device is forgotten, owner and all
            self.free_or_keep(b, seq, emit_release=False)

    def fork(self, parent: Any, child: Any) -> None:
        p = self.require(parent)
        if p.pending:
            raise ValueError(f"fork of {parent!r} with {p.pending} reserved tokens not committed")
        self.add(child, prompt_len=p.length, priority=p.priority)
        if self.cache.prefix is not None:
            self.cache.prefix.forked(parent, child)
        c = self[child]
        c.length = p.length
        c.blocks = list(p.blocks)
        for b in c.blocks:
            self.cache.pool.share(b, child)

    def adopt(self, seq: Any, source: Any) -> None:
        s, src = self.require(seq), self.require(source)
        if s is src:
            return
        if s.pending or src.pending:
            raise ValueError(f"adopt of {source!r} by {seq!r} with reserved tokens not committed "
                             f"({src.pending} and {s.pending})")
        if s.length != src.length:
            raise ValueError(f"adopt of {source!r} ({src.length} tokens) by {seq!r} ({s.length} tokens): "
                             "the lengths must match; fork a new sequence instead")
        held = {b.id for b in s.blocks}
        for b in src.blocks:
            if b.id not in held:
                self.cache.pool.share(b, seq)  # before the releases: a block both hold never loses its last owner
        kept = {b.id for b in src.blocks}
        old, s.blocks = s.blocks, list(src.blocks)
        s.index_cache = None
        for b in reversed(old):
            if b.id not in kept:
                self.free_or_keep(b, seq, emit_release=True)

    def rollback(self, seq: Any, n: int) -> None:
        c, bs = self.cache, self.cache.block_size
        s = self.require(seq)
        if s.pending:
            raise ValueError(f"rollback of {seq!r} with {s.pending} reserved tokens not committed")
        if not 1 <= n <= s.length:
            raise ValueError(f"rollback of {n} tokens for {seq!r}: must be in [1, {s.length}] (its length)")
        new_len = s.length - n
        if new_len and s.blocks and all(b.index != (new_len - 1) // bs for b in s.blocks):
            raise ValueError(f"rollback of {seq!r} to {new_len} tokens: the block holding its new last token was evicted")
        cut = next((b for b in s.blocks if b.index == new_len // bs), None)
        merged = c.merged.get(cut.id) if cut is not None else None
        if new_len % bs and merged is not None and merged.counts is not None:
            raise ValueError(f"rollback of {seq!r} to {new_len} tokens: block {cut.id} holding its new last token "
                             "has merged tokens (merging keeps the newest local_blocks blocks' worth of tokens whole: widen it)")
        if c.faults.rollback_uncut and new_len:
            s.version += n  # the fault: the rollback is recorded, and the tokens stay
            if c.bus.enabled:
                c.bus.emit(Rollback, seq=seq, n=n, version=s.version)
            return
        s.length = new_len
        s.version += n
        if c.bus.enabled:
            c.bus.emit(Rollback, seq=seq, n=n, version=s.version)
        if c.prefix is not None:
            c.prefix.rolled_back(seq, new_len)
        self.drop_tail(s, emit_release=True)

    # ---- giving blocks up ----
    def drop_tail(self, s: SeqState, *, emit_release: bool) -> None:
        """Let go of blocks wholly past the sequence's length (after a short commit or a rollback)."""
        while s.blocks and s.blocks[-1].index * self.cache.block_size >= s.length:
            b = s.blocks.pop()
            s.index_cache = None
            self.free_or_keep(b, s.id, emit_release=emit_release)

    def free_or_keep(self, b: Block, seq: Any, *, emit_release: bool) -> None:
        """``seq`` lets go of ``b``; the block is freed if nobody else owns it."""
        pool = self.cache.pool
        if pool.blocks.get(b.id) is not b:
            return  # only the prefix-freed-in-use fault gets here: the cache dropped the block under its reader
        self.cache.mover.try_settle(b)  # the block is being dropped anyway: a bad copy of it is simply discarded
        if pool.release(b, seq, emit=emit_release):
            pool.free(b)

    def evict(self, victims: list[Block], tier: str, reason: str = "capacity") -> None:
        """Drop ``victims`` for good, from every owner's table (an ``evict`` event each)."""
        c = self.cache
        for b in victims:
            if c.prefix is not None:
                c.prefix.forget(b)
            for o in b.owners:
                s = self.get(o)
                if s is not None:
                    s.blocks.remove(b)
                    s.index_cache = None
            if c.bus.enabled:
                c.bus.emit(Evict, block=b.id, tier=tier, reason=reason)
            c.pool.drop(b)

    # ---- what the eviction policy asks ----
    def is_evictable(self, b: Block) -> bool:
        # a sequence's newest block is never evicted: its next token is written there
        return all(self[o].blocks[-1] is not b for o in b.owners if o in self)

    def distance(self, b: Block) -> float:
        s = self.get(b.owners[0])
        if s is None:
            return 1.0
        end = max(s.length + s.pending, 1)
        return min(max(end - b.index * self.cache.block_size, 0) / end, 1.0)

    def held(self, seqs: Iterable[Any]) -> dict[Any, Held]:
        """What each of ``seqs`` that the table holds has (the others are left out), in one pass over their blocks."""
        out = {}
        for seq in seqs:
            s = self.get(seq)
            if s is None:
                continue
            on_device, away = 0, False
            for b in s.blocks:
                flight = b.inflight
                on_device += b.tier == Tier.DEVICE or (flight is not None and flight.dst == Tier.DEVICE)
                away = away or b.tier != Tier.DEVICE or flight is not None
            out[seq] = Held(s.length, on_device, away)
        return out

    def num_tokens(self, seq: Any) -> int:
        """Tokens ``gather`` returns: committed and reserved, less any evicted blocks."""
        s = self.require(seq)
        if not s.blocks:
            return 0
        bs = self.cache.block_size
        return (len(s.blocks) - 1) * bs + (s.length + s.pending - s.blocks[-1].index * bs)
