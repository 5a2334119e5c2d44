"""Sessions: every source (trace, followed trace, workload command, engine bus) through the
same checks, with findings as they happen and the end-of-trace rules at the end."""

from __future__ import annotations

import sys
import threading
import time

from check_traces import HEADER, clean_events, leaky_events, request, write_trace

from kvdoctor.engine.bus import Bus
from kvdoctor.events import Alloc, SeqEnd, SeqStart
from kvdoctor.session import (
    BusSource, CommandSource, FollowSource, Session, TraceSource, open_source,
)
from kvdoctor.trace import TraceWriter


def test_iterating_a_trace_yields_each_event_with_what_it_completed(tmp_path):
    path = write_trace(tmp_path / "t.kvtrace", leaky_events())
    session = Session(TraceSource(path))
    items = list(session)
    # every event once, then the end marker
    assert items[-1][0] is None
    assert sum(1 for ev, _ in items if ev is not None) == session.num_events == len(leaky_events()) + 1
    # the leak is completed by r1's step_end, not later
    (ev, found), = [(ev, found) for ev, found in items if found and found[0].rule == "unreachable-swapped"]
    assert type(ev).__name__ == "StepEnd" and ev.step == 1
    assert [(f.rule, f.seq, f.block) for f in found] == [("unreachable-swapped", "r1", 1)]
    assert session.header == HEADER
    assert sorted(f.rule for f in session.findings) == ["unknown-block", "unreachable-swapped"]


def test_run_then_report(tmp_path):
    path = write_trace(tmp_path / "t.kvtrace", leaky_events())
    report = Session(TraceSource(path)).run().report()
    assert report.counts() == {"error": 1, "warning": 1, "info": 0}
    assert report.exit_code == 1
    assert report.trace_path == str(path)


def test_a_truncated_trace_is_checked_and_noted(tmp_path):
    path = write_trace(tmp_path / "t.kvtrace", clean_events(2), close=False)
    with open(path, "ab") as f:
        f.write(b'{"kind":"seq_start","seq":"x"')  # a killed writer's last line
    session = Session(open_source(path)).run()
    report = session.report()
    assert report.truncated and session.findings == []
    assert any("cut short" in n for n in report.notes)


def test_following_a_trace_sees_findings_while_it_is_still_written(tmp_path):
    # GIVEN a writer that only finishes after the consumer has seen the leak
    path = tmp_path / "live.kvtrace"
    seen = threading.Event()
    writer = TraceWriter(path, HEADER)

    def produce():
        writer.write_many(request("r1", 1, step=0, leak=True))
        seen.wait(10)
        writer.write_many(request("r2", 2, step=1))
        writer.close()

    thread = threading.Thread(target=produce)
    thread.start()
    # WHEN a session follows it
    session = Session(FollowSource(path, wait_s=5, poll_s=0.01))
    for ev, found in session:
        if found:
            assert not writer.closed  # THEN the finding arrives while the trace is still open
            seen.set()
    thread.join()
    assert [f.rule for f in session.findings] == ["unreachable-swapped"]
    assert session.num_events == len(request("r1", 1, leak=True) + request("r2", 2)) + 1  # + trace_end


def test_open_source_reads_a_finished_trace_whole(tmp_path):
    path = write_trace(tmp_path / "t.kvtrace", clean_events(1), header=HEADER)
    assert isinstance(open_source(path), TraceSource)
    assert isinstance(open_source(path, follow=True), FollowSource)


def test_every_source_says_why_it_ended(tmp_path):
    # GIVEN a closed trace, one whose last line was cut, and one still followed
    closed = write_trace(tmp_path / "closed.kvtrace", clean_events(1))
    cut = write_trace(tmp_path / "cut.kvtrace", clean_events(1), close=False)
    with open(cut, "ab") as f:
        f.write(b'{"kind":"seq_start"')
    ended = {}
    for name, source in (("read", TraceSource(closed)), ("cut", TraceSource(cut)),
                         ("followed", FollowSource(closed, wait_s=5, poll_s=0.01))):
        # WHEN each is read to its end
        Session(source).run()
        ended[name] = source.ended
    # THEN each gives the reason in words, as the TUI's status line shows it
    assert ended == {"read": "end of trace", "cut": "end of trace (last line cut short)",
                     "followed": "trace closed by its writer"}


def test_a_bus_source_yields_empty_batches_while_the_engine_is_idle_and_keeps_the_first_reason():
    # GIVEN a bus source with a short idle wait
    bus = Bus()
    source = BusSource(bus, idle_s=0.01)
    batches = source.batches()
    # WHEN nothing is emitted THEN the consumer still gets a turn (an empty batch)
    assert next(batches) == []
    # WHEN a step ends THEN its events come as one batch
    bus.emit(SeqStart, seq=1, prompt_len=1)
    bus.end_step()
    assert [type(e).__name__ for e in next(b for b in batches if b)] == ["SeqStart", "StepEnd"]
    # WHEN the engine's thread detaches it, its last events still buffered, and it is closed again
    bus.emit(SeqEnd, seq=1)
    source.detach("the engine's work finished")
    source.close()
    # THEN those events come, the stream ends, the first reason stays and the bus is free of it
    assert [type(e).__name__ for e in next(b for b in batches if b)] == ["SeqEnd"]
    assert list(batches) == []
    assert source.ended == "the engine's work finished" and not bus.enabled


def test_a_bus_source_closed_from_another_thread_ends_at_once_and_leaves_the_bus_to_the_engine():
    # GIVEN a consumer reading a bus source
    bus = Bus()
    source = BusSource(bus, idle_s=0.01)
    # WHEN another thread (the TUI on quit) closes it while the engine goes on
    source.close()
    bus.emit(SeqStart, seq=1, prompt_len=1)
    bus.end_step()
    # THEN the stream ends without the later events, and the bus is untouched until the engine detaches
    assert list(source.batches()) == [] and source.ended == "stopped" and bus.enabled
    source.detach()
    assert not bus.enabled


def test_bus_session_checks_in_the_engine_thread_and_flushes_on_close():
    bus = Bus()
    session = Session.on_bus(bus)
    bus.emit(SeqStart, seq=1, prompt_len=1)
    bus.emit(Alloc, block=3, tier="host", seq=1)
    bus.emit(SeqEnd, seq=1)  # still buffered in the bus: no step end yet
    assert session.num_events == 0
    end = session.close()
    assert [(f.rule, f.block) for f in end] == [("left-at-end", 3)]
    assert not bus.enabled  # detached


def test_bus_source_hands_batches_to_a_consumer_thread():
    bus = Bus()
    source = BusSource(bus)
    session = Session(source)
    result = {}
    consumer = threading.Thread(target=lambda: result.setdefault("s", session.run()))
    consumer.start()
    for ev in request("r1", 1, leak=True):
        bus.emit(type(ev), **{k: getattr(ev, k) for k in ev.__struct_fields__ if k not in ("t", "step")})
    bus.end_step()
    source.close()
    consumer.join(5)
    assert [f.rule for f in session.findings] == ["unreachable-swapped"]


WORKLOAD = """
import os, sys
sys.path.insert(0, {tests!r})
from check_traces import HEADER, leaky_events
from kvdoctor.trace import TraceWriter
w = TraceWriter(os.environ["KVDOCTOR_TRACE"], HEADER)
for ev in leaky_events():
    w.write(ev)
w.close()
print("workload output goes to stderr")
sys.exit({code})
"""


def test_command_source_runs_a_workload_with_tracing_on(tmp_path):
    tests = str(__import__("pathlib").Path(__file__).parent)
    source = CommandSource([sys.executable, "-c", WORKLOAD.format(tests=tests, code=3)])
    session = Session(source).run()
    assert sorted(f.rule for f in session.findings) == ["unknown-block", "unreachable-swapped"]
    assert source.returncode == 3
    assert "workload crashed (exit 3)" in session.report().notes


def test_command_that_never_traces_is_a_trace_error():
    import pytest

    from kvdoctor.errors import TraceError

    source = CommandSource([sys.executable, "-c", "pass"])
    with pytest.raises(TraceError, match="exited before writing a trace"):
        Session(source).run()
    time.sleep(0)  # the source cleaned up its temp dir
