"""Random row operations on EngineCache keep the allocator's reference counts right.

A hypothesis state machine drives the rows of an ``EngineCache`` (over an engine of its own,
no model: the K/V are random tensors written through the engine) through what generate does to
a batch: decode steps that append to every row, beam reorders, row selection (duplicates and
drops included), batch expansion, crops, and swaps of shared blocks to the host. After every
step it checks:
- each block's reference count (its owner list) is the number of rows holding it, with no owner
  twice, and the ownership the events alone describe is the same;
- no block is left allocated without an owner, and the engine holds exactly the batch's rows;
- every row reads back the K/V of the row it continues, though rows share blocks (a write
  into a shared partial block copied it first);
and at the end, once the rows have finished, that every block was freed exactly once, when its
last owner let go, and that every check over the events finds nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine_support import Recorder, tiny_config
from kvdoctor.checks import make_suite
from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.model.hf import EngineCache

MAX_ROWS = 6
MAX_LEN = 16  # tokens per row: 4 blocks of 4, so the rows always fit the device


class Owners:
    """Block ownership as the events alone tell it, asserting the refcount rules as they happen."""

    def __init__(self) -> None:
        self.owners: dict[int, set[Any]] = {}
        self.frees: dict[int, int] = {}  # block id -> lives ended by a free (ids are reused)

    def observe(self, e: Any) -> None:
        kind = type(e).__struct_config__.tag
        if kind == "alloc":
            assert e.block not in self.owners, f"alloc of block {e.block}, which is allocated"
            self.owners[e.block] = {e.seq}
        elif kind == "share":
            assert e.seq not in self.owners[e.block], f"{e.seq!r} shares block {e.block} it already owns"
            self.owners[e.block].add(e.seq)
        elif kind == "release":
            self.owners[e.block].remove(e.seq)
        elif kind == "seq_end":
            for held in self.owners.values():
                held.discard(e.seq)
        elif kind in ("free", "evict"):
            assert e.block in self.owners, f"{kind} of block {e.block}, which is not allocated (freed twice?)"
            assert not self.owners[e.block], f"{kind} of block {e.block} still owned by {self.owners[e.block]}"
            del self.owners[e.block]
            self.frees[e.block] = self.frees.get(e.block, 0) + 1


class RowsMachine(RuleBasedStateMachine):
    @initialize(rows=st.integers(1, 3), n=st.integers(1, 9))
    def setup(self, rows, n):
        engine = PagedKVCache(tiny_config(device_blocks=MAX_ROWS * 6, host_blocks=12, disk_blocks=0))
        self.r = Recorder(engine)
        self.events: list[Any] = []
        self.owners = Owners()
        self.suite = make_suite()
        engine.bus.subscribe(self.events.extend)
        engine.bus.subscribe(lambda evs: [self.owners.observe(e) for e in evs])
        engine.bus.subscribe(self.suite.observe_many)
        self.cache = EngineCache(cache=engine, seqs=[f"row{i}" for i in range(rows)])
        for seq in self.cache.seqs:
            self.r.add(seq, n)
        self.engine.end_step(rows * n)

    @property
    def engine(self) -> PagedKVCache:
        return self.cache.engine

    def _length(self) -> int:
        return self.engine.seq_len(self.cache.seqs[0])

    def _moved(self, sources: list[int]) -> None:
        """What the row operation just done means for the K/V each row must read back."""
        old = [self.r.kv[seq] for seq in self._before]
        self.r.kv = {seq: list(old[s]) for seq, s in zip(self.cache.seqs, sources)}  # writes replace list items
        self.engine.end_step(0)

    @rule(n=st.integers(1, 5))
    def decode(self, n):
        if self._length() + n > MAX_LEN:
            return
        for seq in self.cache.seqs:  # one padded batch: every row gets the same number of tokens
            self.r.write(seq, n)
        self.engine.end_step(n * len(self.cache.seqs))

    @rule(data=st.data())
    def reorder(self, data):
        rows = len(self.cache.seqs)
        beam_idx = data.draw(st.lists(st.integers(0, rows - 1), min_size=rows, max_size=rows))
        self._before = list(self.cache.seqs)
        self.cache.reorder_cache(torch.tensor(beam_idx))
        self._moved(beam_idx)

    @rule(data=st.data(), as_mask=st.booleans())
    def select(self, data, as_mask):
        rows = len(self.cache.seqs)
        self._before = list(self.cache.seqs)
        if as_mask:
            mask = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows).filter(any))
            self.cache.batch_select_indices(torch.tensor(mask))
            self._moved([i for i, keep in enumerate(mask) if keep])
        else:
            indices = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=MAX_ROWS))
            self.cache.batch_select_indices(torch.tensor(indices))
            self._moved(indices)

    @rule(repeats=st.integers(1, 3))
    def repeat(self, repeats):
        rows = len(self.cache.seqs)
        if rows * repeats > MAX_ROWS:
            return
        self._before = list(self.cache.seqs)
        self.cache.batch_repeat_interleave(repeats)
        self._moved([b for b in range(rows) for _ in range(repeats)])

    @rule(n=st.integers(1, 5))
    def crop(self, n):
        if n > self._length():
            return
        self.cache.crop(-n)
        self.r.kv = {seq: [(k[:-n], v[:-n]) for k, v in kv] for seq, kv in self.r.kv.items()}
        self.engine.end_step(0)

    @rule(data=st.data())
    def swap_out(self, data):
        """Move some of a row's blocks (shared or not) to the host; reading brings them back."""
        seq = data.draw(st.sampled_from(self.cache.seqs))
        blocks = self.engine.block_table(seq)
        if blocks:
            self.engine.swap_out(data.draw(st.lists(st.sampled_from(blocks), min_size=1, max_size=2, unique=True)))
        self.engine.end_step(0)

    @rule()
    def read(self):
        for seq in self.cache.seqs:
            self.r.assert_intact(seq)
            self.engine.emit_read(seq)
        self.engine.end_step(0)

    @invariant()
    def refcounts(self):
        if not hasattr(self, "cache"):
            return
        eng = self.engine
        eng.bus.flush()
        eng.pool.check()
        rows = self.cache.seqs
        assert len(set(rows)) == len(rows) and set(eng.seqs) == set(rows), (rows, sorted(eng.seqs))
        holders: dict[int, list[Any]] = {}
        for seq in rows:
            for b in eng.seqs[seq].blocks:
                holders.setdefault(b.id, []).append(seq)
        assert set(holders) == set(eng.pool.blocks), "a block is allocated that no row holds, or the reverse"
        for b in eng.pool.blocks.values():
            assert sorted(b.owners) == sorted(holders[b.id]), f"block {b.id}: owners {b.owners}, held by {holders[b.id]}"
        assert self.owners.owners == {i: set(b.owners) for i, b in eng.pool.blocks.items()}
        assert len(self.r.kv) == len(rows)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        try:
            for seq in self.cache.seqs:
                self.r.assert_intact(seq)
            self.cache.finish()
            self.engine.bus.flush()
            # every block was freed when its last owner let go, once per allocation
            assert not self.engine.pool.blocks and not self.owners.owners
            allocs: dict[int, int] = {}
            for e in self.events:
                if type(e).__struct_config__.tag == "alloc":
                    allocs[e.block] = allocs.get(e.block, 0) + 1
            assert self.owners.frees == allocs
            findings = self.suite.findings + self.suite.finish()
            assert findings == [], "\n".join(f.message for f in findings)
        finally:
            self.engine.close()


RowsMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_rows_state_machine = RowsMachine.TestCase
