"""Random operation sequences against the cache: accounting, bytes, versions and events stay right.

A hypothesis state machine drives sequences through prompts, decode, forks,
rollbacks, explicit swaps across all three tiers, prefetch, reads and removal,
under tiers small enough that demotion and eviction happen all the time.
After every step it checks:
- per tier, free + used == capacity and the slots held match the blocks there;
- every block is in exactly one tier, and the tier the events put it in;
- what ``gather`` returns equals what was written, through any chain of swaps;
- a sequence's version never goes back; swaps and reads carry the version of the last write;
- once every sequence has ended, nothing is left allocated anywhere.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine_support import Recorder, tiny_config
from kvdoctor.engine.cache import PagedKVCache
from kvdoctor.engine.errors import OutOfBlocks

MAX_LEN = 20  # tokens per sequence: at most 5 blocks of 4, so one sequence always fits the device


class Ledger:
    """What the events alone say: allocated blocks, their tier and last written version."""

    def __init__(self) -> None:
        self.tier: dict[int, str] = {}
        self.written: dict[int, int] = {}
        self.seq_version: dict[object, int] = {}

    def observe(self, e) -> None:
        kind = type(e).__struct_config__.tag
        if kind == "alloc":
            assert e.block not in self.tier, f"alloc of allocated block {e.block}"
            self.tier[e.block] = e.tier
            self.written.pop(e.block, None)
        elif kind in ("free", "evict"):
            assert e.block in self.tier, f"{kind} of unallocated block {e.block}"
            if kind == "evict":
                assert self.tier[e.block] == e.tier
            del self.tier[e.block]
        elif kind in ("swap_out", "swap_in"):
            assert self.tier[e.block] == e.src, f"{kind} of block {e.block} from {e.src}, events say {self.tier[e.block]}"
            self.tier[e.block] = e.dst
            assert e.version == self.written.get(e.block, e.version), f"{kind} of block {e.block} carries a stale version"
        elif kind == "write":
            last = self.seq_version.get(e.seq, 0)
            assert e.version == last + e.n, f"write to {e.seq} jumps version {last} -> {e.version} for {e.n} tokens"
            self.seq_version[e.seq] = e.version
            self.written[e.block] = e.version
        elif kind == "rollback":
            last = self.seq_version.get(e.seq, 0)
            assert e.version >= last + 1
            self.seq_version[e.seq] = e.version
        elif kind == "read":
            for b, v in zip(e.blocks, e.versions):
                assert b in self.tier and v == self.written.get(b, v), f"read of block {b} at version {v}"


class CacheMachine(RuleBasedStateMachine):
    rules_run = 0  # rule applications across all examples (for reporting the test's depth)
    @initialize(policy=st.sampled_from(["lru", "hybrid"]), device=st.integers(6, 8), host=st.integers(2, 6),
                disk=st.integers(2, 8), prefetch=st.integers(0, 3))
    def setup(self, policy, device, host, disk, prefetch):
        self.dir = tempfile.mkdtemp(prefix="kvd-sm-")
        cfg = tiny_config(device_blocks=device, host_blocks=host, disk_blocks=disk, eviction=policy,
                          prefetch_depth=prefetch, chunk_blocks=3, disk_dir=self.dir)
        self.r = Recorder(PagedKVCache(cfg))
        self.ledger = Ledger()
        self.r.cache.bus.subscribe(lambda evs: [self.ledger.observe(e) for e in evs])
        self.next_id = 0
        self.versions: dict[object, int] = {}
        for n in (5, 9):  # start with two sequences so every rule has something to act on
            self.new_sequence(n)

    @property
    def cache(self) -> PagedKVCache:
        return self.r.cache

    def seqs(self) -> list:
        return sorted(self.cache.seqs, key=str)

    @rule(n=st.integers(1, 12))
    def new_sequence(self, n):
        seq = self.next_id
        self.next_id += 1
        try:
            self.r.add(seq, n)
        except OutOfBlocks:
            self.cache.remove_sequence(seq, reason="aborted")

    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        if not self.cache.seqs:
            return
        seq = data.draw(st.sampled_from(self.seqs()))
        if self.cache.seq_len(seq) + n > MAX_LEN:
            return
        try:
            self.r.write(seq, n)
        except OutOfBlocks:
            pass  # nothing changed; the scheduler would wait or preempt

    @rule(data=st.data())
    def fork(self, data):
        if not self.cache.seqs:
            return
        parent = data.draw(st.sampled_from(self.seqs()))
        child = self.next_id
        self.next_id += 1
        self.r.fork(parent, child)

    @rule(data=st.data(), n=st.integers(1, 6))
    def rollback(self, data, n):
        if not self.cache.seqs:
            return
        seq = data.draw(st.sampled_from(self.seqs()))
        if n > self.cache.seq_len(seq):
            return
        try:
            self.r.rollback(seq, n)
        except ValueError as exc:
            assert "evicted" in str(exc)

    @rule(data=st.data(), reason=st.sampled_from(["finished", "aborted"]))
    def remove(self, data, reason):
        if not self.cache.seqs:
            return
        seq = data.draw(st.sampled_from(self.seqs()))
        self.cache.remove_sequence(seq, reason=reason)
        del self.r.kv[seq]

    @rule(data=st.data(), dst=st.sampled_from(["host", "disk", "device"]))
    def swap(self, data, dst):
        if not self.cache.pool.blocks:
            return
        ids = sorted(self.cache.pool.blocks)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=4, unique=True))
        try:
            if dst == "device":
                self.cache.swap_in(chosen)
            else:
                self.cache.swap_out(chosen, dst)
        except OutOfBlocks:
            pass

    @rule(data=st.data())
    def prefetch(self, data):
        if not self.cache.seqs:
            return
        self.cache.prefetch(data.draw(st.sampled_from(self.seqs())))
        # let the worker finish, so what a later rule finds never depends on thread timing
        # (hypothesis replays must see the same states)
        self.cache.tiers.drain()

    @rule(data=st.data())
    def read(self, data):
        if not self.cache.seqs:
            return
        seq = data.draw(st.sampled_from(self.seqs()))
        try:
            self.r.assert_intact(seq)
        except OutOfBlocks:
            return
        self.cache.emit_read(seq)

    @rule()
    def end_step(self):
        self.cache.end_step()


    @invariant()
    def accounting(self):
        if not hasattr(self, "r"):
            return
        CacheMachine.rules_run += 1
        c = self.cache
        c.pool.check()
        self.cache.bus.flush()
        for t, ts in c.pool.tiers.items():
            assert ts.used + ts.num_free == ts.capacity
        in_flight = {b.id for b in c.pool.blocks.values() if b.inflight is not None}
        assert self.ledger.tier == {b.id: b.tier for b in c.pool.blocks.values()} or in_flight
        for seq, s in c.seqs.items():
            assert s.version >= self.versions.get(seq, 0)
            self.versions[seq] = s.version
            assert all(seq in b.owners for b in s.blocks)

    def teardown(self):
        if not hasattr(self, "r"):
            return
        try:
            for seq in self.seqs():
                self.cache.remove_sequence(seq)
            self.cache.end_step()
            st_ = self.cache.stats()
            assert st_["blocks"] == 0 and all(t["used_blocks"] == 0 for t in st_["tiers"].values())
            assert self.ledger.tier == {}
        finally:
            self.cache.close()
            shutil.rmtree(self.dir, ignore_errors=True)


CacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_cache_state_machine = CacheMachine.TestCase
