"""The cache as the events describe it: who owns each block, where it sits, what it holds.

Every check judges an event against the state that the events *before* it built, so the
state is kept once, here, and shared by all checks of a suite (a suite applies each event
to the ledger after its checks have seen it). Hot fields are plain dicts keyed by block id,
because the replay goal is hundreds of thousands of events per second: a dict lookup is
the cheapest thing Python has. A block's history is a bounded deque of the events
themselves (frozen, already allocated), turned into dicts only when a finding needs them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Callable

from ..events import (
    PREFIX_CACHE, Alloc, Event, Evict, Free, Merge, Recode, Release, Rollback, SeqEnd, SeqStart, Share, Snapshot,
    SwapIn, SwapOut, Write, to_dict,
)

__all__ = ["Ledger", "SeqState", "FREED_KEPT", "ENDED_KEPT"]

# What the ledger remembers of the past, by default (``[tool.kvdoctor.limits]`` sets both): the
# state of live blocks and sequences is bounded by the engine, but freed ids and ended sequences
# would grow with every request served.
FREED_KEPT = 4096  # freed block ids whose last life is kept for "read after free"/"double free" evidence
ENDED_KEPT = 65536  # ended sequence ids remembered, to tell "ended" from "never seen"
# Ended sequences whose recorded stacks are kept (older ones keep their id and place only): a producer's stacks
# are most of what an ended sequence costs (~1 KB, against ~100 bytes), and a finding about a sequence that ended
# thousands of sequences ago is rare. Without this bound 8 traces of 2 M events held 345 MB.
ENDED_STACKS_KEPT = 4096


class SeqState:
    """One live sequence: its cache version, cached length and the blocks it owns.

    ``version``/``length`` are ``None`` when the events cannot tell them (a sequence first
    seen without ``seq_start``, or one that took shared blocks before writing anything).
    """

    __slots__ = ("seq", "version", "length", "blocks")

    def __init__(self, seq: Any, start: SeqStart | None) -> None:
        self.seq = seq
        self.version: int | None = 0 if start is not None else None
        self.length: int | None = 0 if start is not None else None
        self.blocks: set[int] = set()


class Ledger:
    """Updated by the suite after the checks saw each event (``appliers``); checks read it.

    It is also the one fold of block ownership and tiers: the TUI's block map applies the same
    updates (``OWNERSHIP``), so the map and the checks cannot tell two stories about a block.
    """

    # The events that change who owns a block or where it sits; ``owners``, ``tier``, ``used`` and
    # each sequence's ``blocks`` follow from these alone.
    OWNERSHIP: frozenset[type] = frozenset({SeqStart, SeqEnd, Alloc, Share, Release, Free, Evict, SwapOut, SwapIn,
                                          Snapshot})

    def __init__(self, *, history: int = 12, freed_kept: int = FREED_KEPT, ended_kept: int = ENDED_KEPT) -> None:
        self.history_len = history
        self.freed_kept = freed_kept
        self.ended_kept = ended_kept
        # Freed ids dropped from ``freed`` (over ``freed_kept``): from the first one on, an id that is
        # not allocated may have been freed long ago, and a finding must not say "never allocated".
        self.num_freed_forgotten = 0
        self.owners: dict[int, set] = {}  # allocated block -> its owner sequences
        self.tier: dict[int, str] = {}  # allocated block -> tier it sits in
        self.version: dict[int, int] = {}  # block -> version of the last write into it
        self.alloc_event: dict[int, Alloc] = {}
        self.hist: dict[int, deque] = {}  # block -> its latest events (bounded)
        self.used: dict[str, int] = {}  # tier -> allocated blocks there
        self.seqs: dict[Any, SeqState] = {}
        self.ended: OrderedDict[Any, int] = OrderedDict()  # seq -> step it ended
        # Recently freed ids -> (the free/evict, the alloc, its last events), for evidence.
        self.freed: OrderedDict[int, tuple[Event, Alloc | None, deque]] = OrderedDict()
        # Blocks left with no owner and not yet freed -> the step they lost their last owner;
        # ``stranded`` are orphans past their deadline, already reported by the leak check.
        self.orphans: dict[int, int] = {}
        self.stranded: dict[int, int] = {}
        # The user's stacks the producer recorded (empty when it records none), per sequence and kind:
        # its seq_start's, its first alloc's, its seq_end's; kept for the last ``ENDED_STACKS_KEPT`` sequences that
        # ended (at most as many as ``ended`` keeps; in the order they ended, ``_stacks_ended``).
        self.seq_stacks: dict[Any, dict[str, list[str]]] = {}
        self._stacks_ended: deque = deque()
        # Each sequence's place in the order sequences started (kept as long as ``ended`` keeps it): what a
        # finding's fingerprint names instead of an id a server draws at random (``Finding.key``)
        self.seq_index: dict[Any, int] = {}
        self._seqs_started = 0
        self.step = 0
        self.ownerless_at_attach: set[int] = set()  # blocks a trace that starts mid-run (a ``snapshot``) found leaked
        self._apply: dict[type, Callable[[Any], None]] = {
            SeqStart: self._seq_start, SeqEnd: self._seq_end, Alloc: self._alloc,
            Share: self._share, Release: self._release, Free: self._free, Evict: self._free,
            Write: self._write, SwapOut: self._swap, SwapIn: self._swap, Rollback: self._rollback,
            Recode: self._recode,
            Merge: self._recode, Snapshot: self._snapshot,
        }

    # ---- reading --------------------------------------------------------------------

    def owner(self, block: int) -> Any:
        """One owner of ``block`` to name in a finding (the first by name when it is shared), or None."""
        owners = self.owners.get(block)
        if not owners:
            return None
        return next(iter(owners)) if len(owners) == 1 else sorted(owners, key=str)[0]

    def block_history(self, block: int) -> list[dict]:
        """The block's story as event dicts: its ``alloc`` first, then its latest events
        (for a freed id, the story of its last life, ending with the ``free``/``evict``)."""
        hist = self.hist.get(block)
        first = self.alloc_event.get(block)
        if hist is None:
            kept = self.freed.get(block)
            if kept is None:
                return []
            _, first, hist = kept
        events = list(hist)
        if first is not None and (not events or events[0] is not first):
            events.insert(0, first)
        return [to_dict(e) for e in events]

    def stacks(self, block: int | None, seq: Any) -> dict[str, list[str]]:
        """The user's code behind a finding about ``block`` and/or ``seq``, first the most telling: where
        ``seq`` started when it is not the sequence that allocated ``block`` (a read or write of another's
        block: the misuse is the newcomer's), where the block was allocated (its alloc's stack, else its
        sequence's first), and where the sequence ended (the finish or abort that left the block behind).
        Empty when the producer recorded none."""
        out: dict[str, list[str]] = {}
        if not self.seq_stacks:
            return out
        alloc = None
        if block is not None:
            alloc = self.alloc_event.get(block)
            if alloc is None and block in self.freed:
                alloc = self.freed[block][1]
        recorded = self.seq_stacks.get(seq, {})
        if (alloc is None or alloc.seq != seq) and "seq_start" in recorded:
            out["seq_start"] = recorded["seq_start"]
        if alloc is not None:
            stack = alloc.stack or self.seq_stacks.get(alloc.seq, {}).get("alloc")
            if stack:
                out["alloc"] = stack
            if seq is None:
                recorded = self.seq_stacks.get(alloc.seq, {})
        if "seq_end" in recorded:
            out["seq_end"] = recorded["seq_end"]
        return out

    def strand(self, block: int) -> None:
        """Mark an orphan as overdue (reported), so later steps do not look at it again."""
        self.stranded[block] = self.orphans.pop(block)

    def freed_by(self, block: int) -> Event | None:
        """The ``free``/``evict`` that last released this id, if remembered."""
        kept = self.freed.get(block)
        return kept[0] if kept is not None else None

    def never_allocated(self) -> str:
        """How to say that an id the ledger has no trace of was never allocated: plainly, until the
        bound on freed blocks made it forget one; from then on it may have been freed long ago."""
        if not self.num_freed_forgotten:
            return "never allocated"
        return (f"not among the {self.freed_kept} most recently freed blocks kvdoctor keeps "
                f"(limits.freed_blocks): freed earlier, or never allocated")

    # ---- applying -------------------------------------------------------------------

    def appliers(self) -> dict[type, Callable[[Any], None]]:
        """Event type -> the update it makes (for a suite's single dispatch table)."""
        return dict(self._apply)

    def _seq(self, seq: Any) -> SeqState:
        state = self.seqs.get(seq)
        if state is None:
            state = self.seqs[seq] = SeqState(seq, None)
        return state

    def _note(self, block: int, event: Event) -> None:
        hist = self.hist.get(block)
        if hist is not None:
            hist.append(event)

    def _number(self, seq: Any) -> None:
        """Give ``seq`` the next place in the order sequences started, unless it has one."""
        if seq not in self.seq_index:
            self.seq_index[seq] = self._seqs_started
            self._seqs_started += 1

    def _seq_start(self, ev: SeqStart) -> None:
        self.seqs[ev.seq] = SeqState(ev.seq, ev)
        self._number(ev.seq)
        self.ended.pop(ev.seq, None)
        if ev.stack:
            self.seq_stacks[ev.seq] = {"seq_start": ev.stack}

    def _seq_end(self, ev: SeqEnd) -> None:
        state = self.seqs.pop(ev.seq, None)
        self.ended[ev.seq] = ev.step
        if ev.stack:
            self.seq_stacks.setdefault(ev.seq, {})["seq_end"] = ev.stack
        if len(self.ended) > self.ended_kept:
            gone, _ = self.ended.popitem(last=False)
            self.seq_index.pop(gone, None)
        if ev.seq in self.seq_stacks:
            self._stacks_ended.append(ev.seq)
            if len(self._stacks_ended) > min(ENDED_STACKS_KEPT, self.ended_kept):
                gone = self._stacks_ended.popleft()
                if gone not in self.seqs:  # not started again since
                    self.seq_stacks.pop(gone, None)
        if state is None:
            return
        # seq_end releases every block the sequence still owns.
        for block in state.blocks:
            owners = self.owners.get(block)
            if owners is None:
                continue
            owners.discard(ev.seq)
            self._note(block, ev)
            if not owners:
                self.orphans[block] = ev.step

    def _alloc(self, ev: Alloc) -> None:
        block = ev.block
        old_tier = self.tier.get(block)
        if old_tier is not None:  # an id reused while allocated: the accounting check reports it
            self.used[old_tier] -= 1
        self.owners[block] = {ev.seq}
        self.tier[block] = ev.tier
        self.used[ev.tier] = self.used.get(ev.tier, 0) + 1
        self.version.pop(block, None)
        self.alloc_event[block] = ev
        self.hist[block] = deque((ev,), self.history_len)
        self.orphans.pop(block, None)
        self.stranded.pop(block, None)
        self._seq(ev.seq).blocks.add(block)
        if ev.stack:
            self.seq_stacks.setdefault(ev.seq, {}).setdefault("alloc", ev.stack)

    def _share(self, ev: Share) -> None:
        owners = self.owners.get(ev.block)
        if owners is None:
            return
        owners.add(ev.seq)
        self.orphans.pop(ev.block, None)
        self.stranded.pop(ev.block, None)
        self.hist[ev.block].append(ev)
        state = self._seq(ev.seq)
        if not state.blocks and not state.length:
            state.length = None  # its cached length now depends on what it shared
        state.blocks.add(ev.block)

    def _release(self, ev: Release) -> None:
        owners = self.owners.get(ev.block)
        if owners is None or ev.seq not in owners:
            return
        owners.discard(ev.seq)
        self.hist[ev.block].append(ev)
        if not owners:
            self.orphans[ev.block] = ev.step
        state = self.seqs.get(ev.seq)
        if state is not None:
            state.blocks.discard(ev.block)
            if not state.blocks:
                state.length = 0  # preempted for recompute: nothing cached any more

    def _free(self, ev: Free | Evict) -> None:
        block = ev.block
        owners = self.owners.pop(block, None)
        if owners is None:
            return
        tier = self.tier.pop(block)
        self.used[tier] -= 1
        self.version.pop(block, None)
        self.orphans.pop(block, None)
        self.stranded.pop(block, None)
        hist = self.hist.pop(block)
        hist.append(ev)
        freed = self.freed
        freed.pop(block, None)  # a reused id: its newest life goes to the end of the line
        freed[block] = (ev, self.alloc_event.pop(block, None), hist)
        if len(freed) > self.freed_kept:
            freed.popitem(last=False)
            self.num_freed_forgotten += 1
        evicted = type(ev) is Evict
        for seq in owners:
            state = self.seqs.get(seq)
            if state is not None:
                state.blocks.discard(block)
                if not state.blocks:
                    state.length = 0  # nothing cached any more (preempted for recompute)
                elif evicted:
                    state.length = None  # it lost tokens it still needed

    def _write(self, ev: Write) -> None:
        self.version[ev.block] = ev.version
        hist = self.hist.get(ev.block)
        if hist is not None:
            hist.append(ev)
        state = self.seqs.get(ev.seq)
        if state is None:
            state = self._seq(ev.seq)
        state.version = ev.version
        state.length = ev.pos + ev.n

    def _swap(self, ev: SwapOut | SwapIn) -> None:
        block = ev.block
        tier = self.tier.get(block)
        if tier is None:
            return
        used = self.used
        used[tier] -= 1
        used[ev.dst] = used.get(ev.dst, 0) + 1
        self.tier[block] = ev.dst
        self.hist[block].append(ev)

    def _recode(self, ev: Recode | Merge) -> None:
        self._note(ev.block, ev)  # the block stays where it is: only its precision or its slots are part of its story

    def _rollback(self, ev: Rollback) -> None:
        state = self._seq(ev.seq)
        state.version = ev.version
        if state.length is not None and ev.n > 0:  # a count below 1 drops nothing (the stale check names it)
            state.length = max(0, state.length - ev.n)

    def _snapshot(self, ev: Snapshot) -> None:
        """A trace that starts mid-run: take the cache as it stood, each block allocated to its first owner
        (the alloc its history and a later leak's evidence start from) and shared with the rest; a block with
        no owner left leaked before (``ownerless_at_attach``), its sequence gone already."""
        for s in ev.seqs:
            self._number(s.seq)
            state = self.seqs[s.seq] = SeqState(s.seq, None)
            state.version, state.length = s.version, s.length
        for b in ev.blocks:
            self._alloc(Alloc(t=ev.t, step=ev.step, block=b.block, tier=b.tier, seq=b.owners[0] if b.owners else b.seq,
                              codec=b.codec))
            for owner in b.owners[1:]:
                self._share(Share(t=ev.t, step=ev.step, block=b.block, seq=owner))
            self.version[b.block] = b.version
            if not b.owners:
                self.owners[b.block].clear()
                self.orphans[b.block] = ev.step
                self.ownerless_at_attach.add(b.block)
        live = {s.seq for s in ev.seqs}
        for seq in [q for q in self.seqs if q not in live and q != PREFIX_CACHE]:
            del self.seqs[seq]  # the last owner of a leaked block, ended before the trace began
            self.ended[seq] = ev.step
