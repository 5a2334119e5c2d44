"""The block map and the checks tell one story: on any event stream, after every event, the TUI's
view of each block (tier, owners, shared, unowned) is what the checks' ledger says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.checks import make_suite
from kvdoctor.events import (
    PREFIX_CACHE, Alloc, Evict, Free, Header, Release, SeqEnd, SeqStart, Share, StepEnd, SwapIn, SwapOut, TierSpec,
    Write,
)
from kvdoctor.tui.blocks import FREE, SHARED, TIER_CODES, UNOWNED
from kvdoctor.tui.state import Monitor
from kvdoctor.tui.synthetic import FAULTS, SyntheticWorkload

HEADER = Header(block_size=4, num_layers=1, tiers=[TierSpec(name=t, capacity_blocks=8) for t in TIER_CODES])

# Few block ids and sequences, so allocations, shares, double frees and ends collide often.
_blocks = st.integers(0, 7)
_seqs = st.sampled_from([0, 1, 2, "req-a", PREFIX_CACHE])
_tiers = st.sampled_from(list(TIER_CODES))
_EVENTS = st.one_of(
    st.builds(lambda **kw: (SeqStart, kw), seq=_seqs, prompt_len=st.integers(0, 8)),
    st.builds(lambda **kw: (SeqEnd, kw), seq=_seqs, reason=st.sampled_from(["finished", "aborted"])),
    st.builds(lambda **kw: (Alloc, kw), block=_blocks, tier=_tiers, seq=_seqs),
    st.builds(lambda **kw: (Share, kw), block=_blocks, seq=_seqs),
    st.builds(lambda **kw: (Release, kw), block=_blocks, seq=_seqs),
    st.builds(lambda **kw: (Free, kw), block=_blocks),
    st.builds(lambda **kw: (Evict, kw), block=_blocks, tier=_tiers, reason=st.just("lru")),
    st.builds(lambda **kw: (SwapOut, kw), block=_blocks, src=_tiers, dst=_tiers, version=st.integers(0, 4)),
    st.builds(lambda **kw: (SwapIn, kw), block=_blocks, src=_tiers, dst=_tiers, version=st.integers(0, 4)),
    st.builds(lambda **kw: (Write, kw), block=_blocks, seq=_seqs, pos=st.integers(0, 8), n=st.integers(1, 4),
              version=st.integers(1, 12)),
    st.builds(lambda **kw: (StepEnd, kw), num_tokens=st.integers(0, 4)),
)


def _stamped(drawn: list[tuple[type, dict]]) -> list:
    """The drawn events with the clock and step a producer would give them (a step ends at StepEnd)."""
    events, step = [], 0
    for t, (cls, fields) in enumerate(drawn):
        events.append(cls(t=t, step=step, **fields))
        step += cls is StepEnd
    return events


def assert_view_agrees(monitor: Monitor, ledger, after) -> None:
    """Every allocated block shows in its tier with the ledger's owners; every other block shows free."""
    table = monitor.blocks
    for block, owners in ledger.owners.items():
        rec = table.records.get(block)
        assert rec is not None, f"after {after}: block {block} allocated but not on the map"
        code = table.cells[rec.cell]
        assert code & 3 == TIER_CODES[ledger.tier[block]], f"after {after}: block {block} tier"
        assert set(rec.owners) == owners, f"after {after}: block {block} owners {rec.owners} vs {owners}"
        assert bool(code & SHARED) == (len(owners) > 1), f"after {after}: block {block} shared"
    for block, rec in table.records.items():
        if block not in ledger.owners:
            assert table.cells[rec.cell] == FREE, f"after {after}: block {block} is free for the checks"
    counts = table.tier_counts()
    for name, code in TIER_CODES.items():
        assert sum(counts[code]) == ledger.used.get(name, 0), f"after {after}: blocks on {name}"
    if type(after) is StepEnd:
        shown_unowned = {b for b, rec in table.records.items() if table.cells[rec.cell] & UNOWNED}
        assert shown_unowned == {b for b, owners in ledger.owners.items() if not owners}, f"after {after}"


def replay(header: Header, events) -> tuple[Monitor, object]:
    """What the TUI's worker does with each event (the checks, then the monitor, then the findings),
    holding the view against the checks' ledger after every one."""
    monitor, suite = Monitor(header), make_suite()
    for ev in events:
        found = suite.observe(ev)
        monitor.observe(ev)
        for f in found:
            monitor.add_finding(f)
        assert_view_agrees(monitor, suite.ledger, ev)
    return monitor, suite


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENTS, max_size=60))
def test_the_block_map_agrees_with_the_checks_on_any_event_stream(drawn):
    # GIVEN any stream of ownership and tier events, legal or not (double frees, foreign releases, shares of free ids)
    # WHEN the checks and the TUI's monitor take it event by event
    # THEN after every event both place every block in the same tier with the same owners
    replay(HEADER, _stamped(drawn))


@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_the_block_map_agrees_with_the_checks_on_a_serving_workload(fault):
    # GIVEN a synthetic serving trace (admissions, swaps, aborts), clean or with a fault
    work = SyntheticWorkload(num_steps=90, seed=5, fault=fault)
    # WHEN the TUI's worker replays it THEN the map and the checks agree after every event
    monitor, suite = replay(work.header(), work.events())
    assert suite.ledger.used and monitor.blocks.records


def test_a_sequence_ended_without_seq_start_leaves_its_blocks_unowned_on_the_map_as_for_the_checks():
    # GIVEN a producer that never announces its sequences (as vLLM's KV events do not)
    events = [Alloc(block=3, tier="device", seq="r1"), SeqEnd(seq="r1", reason="aborted"), StepEnd(num_tokens=1)]
    # WHEN the worker replays them
    monitor, suite = replay(HEADER, events)
    # THEN the block stays allocated, without owner, and the map marks it unowned as the ledger does
    rec = monitor.blocks.records[3]
    assert suite.ledger.owners[3] == set() and monitor.blocks.cells[rec.cell] & UNOWNED
