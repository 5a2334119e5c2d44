"""The bounds on what a long run remembers (``[tool.kvdoctor.limits]``): the checks' ledger and the
TUI's monitor stay at their bound on a stream twice as long as it, and find the same things."""

from __future__ import annotations

import pytest

from kvdoctor.config import Config, parse_config
from kvdoctor.errors import UsageError
from kvdoctor.events import Read
from kvdoctor.limits import Limits
from kvdoctor.tui.state import Monitor
from kvdoctor.tui.synthetic import SyntheticWorkload

FREED, ENDED = 200, 50
UNBOUNDED = Limits(freed_blocks=10_000_000, ended_seqs=10_000_000, tui_freed_blocks=10_000_000,
                   tui_ended_seqs=10_000_000)
BOUNDED = Limits(freed_blocks=FREED, ended_seqs=ENDED, tui_freed_blocks=FREED, tui_ended_seqs=ENDED)


def stream(num_steps: int = 700):
    """A serving workload where every allocation takes a fresh block id and, from step 60, blocks
    of requests aborted while swapped out leak: the worst case for memory, with findings."""
    w = SyntheticWorkload(num_steps=num_steps, seed=3, fault="leak-swapped", fresh_ids=True, host_blocks=4096)
    return w.header(), list(w.events())


def key(f):
    return (f.check, f.rule, f.seq, f.block, f.layer, f.step, f.message)


def check(events, limits: Limits, sizes=None):
    suite = Config(limits=limits).make_suite()
    found = []
    for i, ev in enumerate(events):
        found.extend(suite.observe(ev))
        if sizes is not None and i % 500 == 0:
            sizes.append((len(suite.ledger.freed), len(suite.ledger.ended)))
    found.extend(suite.finish())
    return suite, found


def test_the_ledger_stays_at_its_bounds_and_finds_the_same_on_a_stream_twice_as_long():
    # GIVEN a stream that frees and ends more than twice what the bounds keep
    _, events = stream()
    unbounded, expected = check(events, UNBOUNDED)
    assert len(unbounded.ledger.freed) > 2 * FREED and len(unbounded.ledger.ended) > 2 * ENDED
    # WHEN it is checked under the bounds
    sizes: list[tuple[int, int]] = []
    suite, found = check(events, BOUNDED, sizes)
    # THEN what is kept of the past reaches its bound and never passes it
    assert max(s[0] for s in sizes) == FREED and max(s[1] for s in sizes) == ENDED
    assert (len(suite.ledger.freed), len(suite.ledger.ended)) == (FREED, ENDED)
    # ... the live state is the same, and so is every finding, to its sequence, block, step and message
    assert suite.ledger.owners == unbounded.ledger.owners
    assert expected and {f.rule for f in expected} >= {"unreachable-swapped"}
    assert [key(f) for f in found] == [key(f) for f in expected]


def test_a_read_of_a_block_freed_beyond_the_bound_still_names_it_without_claiming_it_never_existed():
    # GIVEN a stream whose first freed block has long left the bounded ledger
    _, events = stream(400)
    first_free = next(ev for ev in events if type(ev).__name__ == "Free")
    last = events[-1]
    late_read = Read(t=last.t + 1, step=last.step, seq="late", blocks=[first_free.block], versions=[0])
    # WHEN a sequence reads it
    findings = {}
    for name, limits in (("unbounded", UNBOUNDED), ("bounded", BOUNDED)):
        _, found = check([*events, late_read], limits)
        findings[name] = next(f for f in found if f.rule == "read-freed")
    # THEN both name the sequence, block and step; only the unbounded one still knows when it was freed
    for f in findings.values():
        assert (f.seq, f.block, f.step) == ("late", first_free.block, last.step)
    assert f"freed at step {first_free.step}" in findings["unbounded"].message
    assert "never allocated" not in findings["bounded"].message.split(":")[0]
    assert f"not among the {FREED} most recently freed blocks" in findings["bounded"].message


def monitor_over(events, header, limits: Limits, sizes=None) -> Monitor:
    """What the TUI's worker does: every event to the checks, then the monitor, then its findings."""
    m, suite = Monitor(header, limits), Config(limits=limits).make_suite()
    for i, ev in enumerate(events):
        found = suite.observe(ev)
        m.observe(ev)
        for f in found:
            m.add_finding(f)
        if sizes is not None and i % 500 == 0:
            sizes.append((len(m.blocks.cells), len(m.blocks.records), len(m._ended), m.blocks.tier_counts()))
    return m


def test_the_tui_block_map_and_ended_sequences_stay_bounded_with_fresh_block_ids():
    # GIVEN the same stream, shown by an unbounded and a bounded monitor
    header, events = stream()
    full = monitor_over(events, header, UNBOUNDED)
    sizes: list = []
    m = monitor_over(events, header, BOUNDED, sizes)
    live = sum(1 for r in full.blocks.records.values() if r.tier)
    assert len(full.blocks.cells) > live + 2 * FREED
    # THEN the map holds the live blocks and at most FREED freed ones (+1 for the id just seen), always
    assert max(s[0] for s in sizes) <= live + FREED + 1 and len(m.blocks.cells) <= live + FREED + 1
    assert max(s[2] for s in sizes) == ENDED
    # ... every cell still points at its own record, the counts add up, and the gauges agree
    table = m.blocks
    assert len(table.ids) == len(table.cells) == len(table.records)
    assert all(table.records[b].cell == i and table.cells[i] == table.records[b].code for i, b in enumerate(table.ids))
    assert sum(table.code_counts.values()) == len(table.cells)
    assert table.tier_counts() == full.blocks.tier_counts()
    assert full.findings and [key(f) for f in m.findings] == [key(f) for f in full.findings]


def test_limits_come_from_the_config_file_and_bad_values_are_usage_errors():
    config = parse_config({"limits": {"freed_blocks": 7, "tui_ended_seqs": 3}})
    assert config.limits == Limits(freed_blocks=7, tui_ended_seqs=3)
    assert config.make_suite().ledger.freed_kept == 7
    with pytest.raises(UsageError, match="limits.freed_blocks must be in"):
        parse_config({"limits": {"freed_blocks": -1}})
    with pytest.raises(UsageError, match="unknown setting limits.blocks"):
        parse_config({"limits": {"blocks": 1}})
