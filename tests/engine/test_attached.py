"""A trace that starts mid-run: the snapshot a cache writes when kvdoctor attaches must leave the checks exactly
where the whole history would have, so attaching at any step of a clean run finds nothing, and a leak made
before attaching is still found."""

from __future__ import annotations

import pytest

from kvdoctor.checks import make_suite
from kvdoctor.engine import Request, Runner, Scheduler
from kvdoctor.engine.kv.attached import snapshot
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.events import PREFIX_CACHE, Snapshot

STEPS = 60


def _serve(attach_at: int, *, abort_swapped: bool = False, fault: str | None = None,
           prefix_cache: bool = True) -> tuple[list, list]:
    """A prefix-cached, swapping workload of a tiny Llama, listened to from step ``attach_at`` on (a snapshot
    first, as an attach writes it); returns its events (the closing ones left out) and its tokens."""
    runner = Runner.create(tiny_llama(num_layers=2).model, block_size=4, device_blocks=16, host_blocks=32,
                           prefix_cache=prefix_cache, fault=fault)
    sched = Scheduler(runner, max_batch=4)
    events: list = []
    for step in range(STEPS):
        if step == attach_at:
            events.append(snapshot(runner.cache))
            runner.cache.bus.subscribe(events.extend)
        if len(sched.live) < 6:
            sched.submit(Request([1, 2, 3, 4, 5, 6, 7, 8] + list(range(10, 14 + step % 9)), max_new_tokens=12,
                                 ignore_eos=True))
        sched.step()
        swapped = [seq for seq, live in sched.live.items() if live.state == "swapped"]
        if abort_swapped and swapped:
            sched.abort(swapped[0])
    runner.cache.bus.flush()
    tokens = [g.token_ids for g in sched.done.values()]
    closing = len(events)
    runner.close()
    return events[:closing], tokens


def _checked(events: list) -> tuple[list, object]:
    suite = make_suite()
    found = suite.observe_many(events)
    return found + list(suite.finish()), suite.ledger


def _state(ledger) -> dict:
    return {"owners": {b: sorted(map(str, o)) for b, o in ledger.owners.items()}, "tier": dict(ledger.tier),
            "version": dict(ledger.version), "used": {t: n for t, n in ledger.used.items() if n},
            "seqs": {s: (st.version, st.length, sorted(st.blocks)) for s, st in ledger.seqs.items()
                     if s != PREFIX_CACHE}}


@pytest.fixture(scope="module")
def whole():
    return _serve(0)


@pytest.mark.parametrize("attach_at", [7, 23, 41])
def test_attaching_mid_run_leaves_the_checks_where_the_whole_history_would(whole, attach_at):
    # GIVEN a clean run traced from its start, and the same run attached to at a later step
    events, tokens = _serve(attach_at)
    assert type(events[0]) is Snapshot and events[0].blocks and events[0].seqs  # the cache held something
    # THEN the attached trace gives no finding at all, and the same tokens came out (listening changes nothing)
    found, ledger = _checked(events)
    assert found == [] and tokens == whole[1]
    # AND the checks' ledger ends exactly where the whole trace's does
    whole_found, whole_ledger = _checked(whole[0])
    assert whole_found == []
    assert _state(ledger) == _state(whole_ledger)


def test_a_leak_made_before_attaching_is_found_at_the_attach():
    # GIVEN a run that strands swapped-out blocks (the leak-swapped fault, requests aborted while swapped out)
    events, _ = _serve(40, abort_swapped=True, fault="leak-swapped", prefix_cache=False)
    stranded = [b for b in events[0].blocks if not b.owners]
    assert stranded, "the fault should have stranded blocks before the attach"
    # WHEN the trace starts at step 40 THEN each block leaked before it is an error that says so
    found, _ = _checked(events)
    early = [f for f in found if f.block in {b.block for b in stranded} and f.step == events[0].step]
    assert {f.block for f in early} == {b.block for b in stranded}
    assert all(f.rule == "unreachable-swapped" and "when kvdoctor attached" in f.message for f in early)
