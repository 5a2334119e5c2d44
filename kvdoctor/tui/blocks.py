"""The block table behind the block map and the tier gauges.

One record per logical block id, updated by the events that move, share or free
it, and one byte per block (its *cell code*) that the block map draws. The cell
codes live in a ``bytearray`` in the order blocks were first seen, so publishing
the map to the UI thread is a single ``bytes()`` copy however many blocks there
are, and the per-tier counts the gauges show are kept by code, so no frame ever
walks the table.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Collection

from ..events import PREFIX_CACHE

__all__ = [
    "FREE", "TIER_CODES", "SHARED", "UNOWNED", "LEAKED", "STALE", "CACHED",
    "BlockRecord", "BlockTable", "cell_tier", "cell_is_leaked",
]

# Low two bits: where the block's live copy is (0 = not allocated). Upper bits: flags.
FREE = 0
TIER_CODES: dict[str, int] = {"device": 1, "host": 2, "disk": 3}
SHARED = 4    # more than one owner (prefix sharing, fork, beam)
UNOWNED = 8   # no owner left at the end of a step, yet not freed: unreachable
LEAKED = 16   # a leak check named this block
STALE = 32    # a stale-version finding or a checksum error named this block
CACHED = 64   # held by a prefix cache (an owner ``prefix-cache``): kept for later requests to reuse

_HISTORY = 24  # events kept per block for the detail pane (the alloc is kept apart)


def cell_tier(code: int) -> int:
    return code & 3


def cell_is_leaked(code: int) -> bool:
    return bool(code & (UNOWNED | LEAKED))


class BlockRecord:
    """What is known about one block id: where it is, who owns it, what happened to it."""

    __slots__ = ("block", "cell", "tier", "owners", "version", "flags", "born", "history", "last_read_step",
                 "codec")

    def __init__(self, block: int, cell: int) -> None:
        self.block = block
        self.cell = cell
        self.tier = FREE
        self.owners: Collection[Any] = frozenset()  # the checks' fold's own set while allocated (see Monitor._sync)
        self.version = 0
        self.flags = 0
        self.born: Any = None  # the Alloc event of the current allocation (with its stack, when recorded)
        self.history: deque[Any] = deque(maxlen=_HISTORY)
        self.last_read_step: int | None = None
        self.codec: str | None = None  # how its bytes are stored, when the producer says (alloc/swap/recode)

    @property
    def code(self) -> int:
        if self.tier == FREE:
            return FREE
        owners = self.owners
        return (self.tier | self.flags | (SHARED if len(owners) > 1 else 0)
                | (CACHED if PREFIX_CACHE in owners else 0))


class BlockTable:
    """Blocks by id, their cell codes, and the number of blocks per code.

    An engine that reuses block ids (a pool) gives a table as large as its pool. One that
    hands out fresh ids would grow it forever, so at most ``max_free`` records of blocks not
    allocated are kept: past that, a new id takes over the cell of the block freed longest ago.
    """

    def __init__(self, max_free: int = 4096) -> None:
        self.records: dict[int, BlockRecord] = {}
        self.ids: list[int] = []          # cell index -> block id
        self.cells = bytearray()          # cell index -> cell code
        self.code_counts: dict[int, int] = {FREE: 0}  # code -> number of cells with it (few codes occur)
        self.max_free = max_free
        self._free: OrderedDict[int, None] = OrderedDict()  # ids of records not allocated, freed longest ago first
        self._ids_version = 0

    @property
    def ids_version(self) -> int:
        """Grows when a new cell appears, so a consumer can reuse its copy of ``ids`` otherwise."""
        return self._ids_version

    def get(self, block: int) -> BlockRecord:
        rec = self.records.get(block)
        if rec is None:
            if len(self._free) > self.max_free:
                # The cell of the block freed longest ago: a FREE cell stays FREE, so no count moves.
                gone, _ = self._free.popitem(last=False)
                cell = self.records.pop(gone).cell
                self.ids[cell] = block
            else:
                cell = len(self.ids)
                self.ids.append(block)
                self.cells.append(FREE)
                self.code_counts[FREE] += 1
            rec = self.records[block] = BlockRecord(block, cell)
            self._ids_version += 1
            self._free[block] = None  # not allocated until its alloc says so
        return rec

    def recode(self, rec: BlockRecord) -> None:
        """Call after changing a record's tier, owners or flags: keeps cell and counts in step."""
        new = rec.code
        old = self.cells[rec.cell]
        if new != old:
            self.cells[rec.cell] = new
            counts = self.code_counts
            counts[old] -= 1
            counts[new] = counts.get(new, 0) + 1
            if new == FREE:
                self._free[rec.block] = None
            elif old == FREE:
                self._free.pop(rec.block, None)

    def tier_counts(self) -> dict[int, tuple[int, int, int]]:
        """Per tier code: (owned by one, shared, leaked or unowned) numbers of blocks."""
        out = {t: [0, 0, 0] for t in TIER_CODES.values()}
        for code, n in self.code_counts.items():
            if not n or code == FREE:
                continue
            bucket = out[code & 3]
            if code & (UNOWNED | LEAKED):
                bucket[2] += n
            elif code & SHARED:
                bucket[1] += n
            else:
                bucket[0] += n
        return {t: (a, b, c) for t, (a, b, c) in out.items()}
