"""Block metadata and per-tier slot accounting: who owns which block, where it lives, which version it holds.

A *block* is ``block_size`` token positions of one sequence's K and V across all
layers. ``Block`` holds what every block has; what a feature knows of some blocks (the attention mass the
hybrid policy ranks by, what token merging left in a block) lives in that feature's side table, keyed by
block id, which the pool empties of a block when it goes (``track``): ids are reused.

A block keeps its id while it moves between tiers; its *slot* is where its bytes sit in the current tier's
arenas. A block also has a *codec*, the lossiest one its bytes went through; it lives in the arena of that
codec in its tier (see ``storage.TierArenas``: the slot number names the arena). The pool never touches
bytes: it hands out ids and slots, keeps the owner sets (the reference count is their size), and emits the
ownership events. Moving bytes is ``mover``'s job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ... import callsite
from ...events import Alloc, Free, Share, Release
from ..bus import Bus
from ..config import EngineConfig
from ..errors import OutOfBlocks

__all__ = ["Block", "TierSlots", "BlockPool"]


@dataclass(eq=False, slots=True)
class Block:
    id: int
    tier: str
    slot: int
    index: int  # position of the block in its sequences: tokens index*block_size …
    owners: list[Any]  # sequence ids; the reference count is len(owners)
    codec: str = ""  # the lossiest codec its bytes went through; it never becomes less lossy
    version: int = 0  # version of the last write into the copy the block now has
    checksum: int | None = None  # of the current bytes; None while they may still change
    last_access: int = 0  # cache tick of the last reserve/gather/ensure_resident touching it
    inflight: Any = None  # the pending asynchronous swap-in (mover._Inflight) not yet settled
    digest: Any = None  # digest.BlockRecord: what its bytes should be; None while unknown (nobody listened)


class TierSlots:
    """Slots of one tier, shared by its codec arenas: the count of blocks living there (the tier's
    capacity is a block count, whatever the codecs) and, per arena, a lowest-first free heap of local
    slots (keeps neighbours together, so swaps copy runs). ``free + used == capacity`` always.

    ``take(arena)`` returns a tier slot ``arena << shift | local`` (``storage.TierArenas``), so arena 0
    hands out the plain slot numbers a single-codec tier always had.
    """

    def __init__(self, name: str, capacity: int, grow: Callable[[int], range], num_arenas: int = 1) -> None:
        self.name, self.capacity, self._grow = name, capacity, grow
        self.shift = max(capacity, 1).bit_length()  # as storage.TierArenas numbers its slots
        self.mask = (1 << self.shift) - 1
        self.free: list[list[int]] = [[] for _ in range(num_arenas)]  # per arena: free local slots (a heap)
        self.grown_by = [0] * num_arenas  # per arena: slots grown so far
        self.used_by = [0] * num_arenas  # per arena: slots holding a block (or a stale-version fault's copy)
        self.used = 0

    @property
    def num_free(self) -> int:
        return self.capacity - self.used

    def grow_fully(self, arena: int = 0) -> None:
        """Grow ``arena`` to the tier's capacity now, so no later ``take`` pays for it."""
        while self.grown_by[arena] < self.capacity:
            new = self._grow(arena)
            self.grown_by[arena] += len(new)
            self.free[arena].extend(new)
        heapq.heapify(self.free[arena])

    def arena_of(self, slot: int) -> int:
        return slot >> self.shift

    def take(self, arena: int = 0) -> int:
        heap = self.free[arena]
        if not heap:
            if self.grown_by[arena] >= self.capacity:
                raise OutOfBlocks(self.name, 1, self.num_free)
            new = self._grow(arena)
            self.grown_by[arena] += len(new)
            heap.extend(new)  # an ascending range is already a heap when appended to an empty heap
            heapq.heapify(heap)
        self.used += 1
        self.used_by[arena] += 1
        return arena << self.shift | heapq.heappop(heap)

    def give(self, slot: int) -> None:
        arena = slot >> self.shift
        self.used -= 1
        self.used_by[arena] -= 1
        heapq.heappush(self.free[arena], slot & self.mask)


class BlockPool:
    """Ids, owners and tier slots of every allocated block; emits alloc/share/release/free."""

    def __init__(self, config: EngineConfig, bus: Bus, grow: dict[str, Callable[[int], range]]) -> None:
        self.config = config
        self.bus = bus
        self.slots: dict[str, TierSlots] = {  # tier name -> its slot table
            t: TierSlots(t, config.capacity(t), grow[t], len(config.arena_codecs(t))) for t in config.tiers}
        self.blocks: dict[int, Block] = {}
        self._free_ids: list[int] = []
        self._next_id = 0
        self.epoch = 0  # advances whenever a block's slot changes or a block goes, so slot tables can be cached
        self._forgets: list[Callable[[int], Any]] = []  # features' side tables letting go of a block (``track``)
        self._held: list[Callable[[], Iterable[tuple[str, int]]]] = []

    def track(self, forget: Callable[[int], Any], held: Callable[[], Iterable[tuple[str, int]]] | None = None) -> None:
        """A feature's side table (block id -> what it knows of that block) joins the pool: ``forget(block_id)``
        for each block the pool drops, so a reused id starts with nothing; ``held()``: the (tier, slot) pairs the
        table holds in the pool's tiers besides the blocks' own, which ``check`` counts."""
        self._forgets.append(forget)
        if held is not None:
            self._held.append(held)

    def lookup(self, ids: Iterable[int]) -> list[Block]:
        """The blocks of ``ids``; a ``ValueError`` names the first one not allocated."""
        try:
            return [self.blocks[i] for i in ids]
        except KeyError as exc:
            raise ValueError(f"block {exc.args[0]} is not allocated") from None

    def _new_id(self) -> int:
        if self._free_ids:
            return heapq.heappop(self._free_ids)
        self._next_id += 1
        return self._next_id - 1

    def alloc(self, tier: str, seq: Any, index: int, codec: str | None = None) -> Block:
        """A new block in ``tier`` owned by ``seq``, held in ``codec`` (default: the tier's own; raises
        ``OutOfBlocks`` if the tier is full)."""
        slots = self.slots[tier]
        if slots.num_free <= 0:
            raise OutOfBlocks(tier, 1, 0)
        codec = codec or self.config.tier_codec(tier)
        blk = Block(self._new_id(), tier, slots.take(self.config.arena_codecs(tier).index(codec)), index, [seq], codec)
        self.blocks[blk.id] = blk
        if self.bus.enabled:  # a sequence's first block carries the user's stack: where a leak of it began
            self.bus.emit(Alloc, block=blk.id, tier=tier, seq=seq, codec=codec, stack=None if index else callsite.user_stack())
        return blk

    def share(self, blk: Block, seq: Any, hash: str | None = None) -> None:
        """``seq`` becomes one more owner; ``hash``: the prefix cache's content key (registration or hit)."""
        blk.owners.append(seq)
        if self.bus.enabled:
            self.bus.emit(Share, block=blk.id, seq=seq, hash=hash)

    def release(self, blk: Block, seq: Any, *, emit: bool = True) -> bool:
        """``seq`` stops owning ``blk``; True when no owner is left (the caller frees it this step)."""
        blk.owners.remove(seq)
        if emit and self.bus.enabled:
            self.bus.emit(Release, block=blk.id, seq=seq)
        return not blk.owners

    def drop(self, blk: Block) -> None:
        """Return the block's slot and id without an event (``free`` and ``evict`` emit their own)."""
        assert blk.inflight is None, f"block {blk.id} dropped with a swap in flight"
        self.epoch += 1
        self.slots[blk.tier].give(blk.slot)
        del self.blocks[blk.id]
        for forget in self._forgets:
            forget(blk.id)
        heapq.heappush(self._free_ids, blk.id)

    def free(self, blk: Block) -> None:
        self.drop(blk)
        if self.bus.enabled:
            self.bus.emit(Free, block=blk.id)

    def move(self, blk: Block, tier: str, slot: int) -> None:
        """Record that ``blk``'s bytes now live at ``slot`` of ``tier`` (the old slot is given back)."""
        self.slots[blk.tier].give(blk.slot)
        blk.tier, blk.slot = tier, slot
        self.epoch += 1

    def check(self) -> None:
        """Assert the accounting invariants (tests and debugging; O(blocks))."""
        for name, ts in self.slots.items():
            codecs = self.config.arena_codecs(name)
            held = [b.slot for b in self.blocks.values() if b.tier == name]
            held += [b.inflight.slot for b in self.blocks.values() if b.inflight is not None and b.inflight.dst == name]
            held += [slot for table in self._held for tier, slot in table() if tier == name]
            assert ts.used == len(held) <= ts.capacity, f"tier {name}: used={ts.used} but {len(held)} slots held"
            assert len(set(held)) == len(held), f"tier {name}: a slot holds two blocks: {sorted(held)}"
            for b in self.blocks.values():
                if b.tier == name:
                    assert codecs[ts.arena_of(b.slot)] == b.codec, (
                        f"block {b.id} ({b.codec}) sits in the {codecs[ts.arena_of(b.slot)]} arena of {name}")
            for i, free in enumerate(ts.free):
                mine = {s & ts.mask for s in held if ts.arena_of(s) == i}
                assert ts.used_by[i] == len(mine), f"tier {name} arena {i}: used={ts.used_by[i]}, {len(mine)} held"
                assert not mine & set(free), f"tier {name} arena {i}: a held slot is also free"
                assert ts.used_by[i] + len(free) == ts.grown_by[i] <= ts.capacity, (
                    f"tier {name} arena {i}: used {ts.used_by[i]} + free {len(free)} != grown {ts.grown_by[i]} "
                    f"(capacity {ts.capacity})")
        for b in self.blocks.values():
            assert b.owners, f"block {b.id} is allocated with no owner"
