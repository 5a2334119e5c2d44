"""The TUI's worker: every event reaches the checks, frames are paced, failures become messages."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvdoctor.trace import TraceWriter
from kvdoctor.tui.feed import LiveFeed, ReplayFeed
from kvdoctor.tui.synthetic import SyntheticWorkload
from kvdoctor.tui.workload import Workload
from tui_helpers import one_trace_feed, workload_feed


class Frames:
    """A publish callback that keeps what it was given."""

    def __init__(self) -> None:
        self.snapshots: list = []

    def __call__(self, snapshot) -> None:
        self.snapshots.append(snapshot)

    @property
    def last(self):
        return self.snapshots[-1]


def run(feed, timeout: float = 30.0):
    feed.start()
    feed.join(timeout)
    assert not feed.is_alive(), "the feed did not finish"
    return feed


def test_live_feed_sees_every_event_of_a_trace_written_while_it_follows(tmp_path: Path):
    # GIVEN a writer that appends 400 steps in small bursts while the feed follows the file
    w = SyntheticWorkload(num_steps=400, fault="leak-swapped")
    events = list(w.events())
    path = tmp_path / "live.kvtrace"
    writer = TraceWriter(path, w.header())

    def write() -> None:
        for i in range(0, len(events), 500):
            writer.write_many(events[i:i + 500])
            time.sleep(0.005)
        writer.close()

    frames = Frames()
    feed = LiveFeed(str(path), frames, fps=50)
    thread = threading.Thread(target=write)
    thread.start()
    run(feed)
    thread.join()
    # THEN the monitor saw every event (plus the closing one) and the checks found the leak
    assert feed.monitor.num_events == len(events) + 1
    assert any(f.check == "leak" for f in frames.last.findings)
    assert frames.last.ended == "trace closed by its writer"
    # AND frames were paced: far fewer snapshots than bursts of events
    assert 1 < len(frames.snapshots) < len(events) // 500 + 10


def test_replay_seek_back_rebuilds_the_same_state_as_playing_forward(leak_trace: Path):
    frames = Frames()
    feed = ReplayFeed(str(leak_trace), frames, start=150)
    feed.start()
    try:
        _wait(lambda: frames.snapshots and "step 150 of" in frames.last.status)
        at_150 = frames.last
        feed.seek(250)
        _wait(lambda: "step 250 of" in frames.last.status)
        feed.seek(150)
        _wait(lambda: "step 150 of" in frames.last.status and frames.last.serial != at_150.serial)
        again = frames.last
        # THEN stepping back gives exactly the state first reached going forward
        assert (again.cells, again.num_events, again.findings, again.step) == \
            (at_150.cells, at_150.num_events, at_150.findings, at_150.step)
        feed.step(1)
        _wait(lambda: "step 151 of" in frames.last.status)
        feed.step(-1)
        _wait(lambda: "step 150 of" in frames.last.status)
        assert frames.last.cells == at_150.cells
    finally:
        feed.stop()
        feed.join(5)


def test_replay_plays_to_the_end_and_runs_the_end_of_trace_rules(leak_trace: Path):
    frames = Frames()
    feed = ReplayFeed(str(leak_trace), frames, speed=0)
    feed.start()
    try:
        _wait(lambda: frames.snapshots and frames.last.ended is not None and "paused" in frames.last.status)
    finally:
        feed.stop()
        feed.join(5)
    assert frames.last.ended == "end of trace"
    assert frames.last.num_findings["error"] > 0


def test_missing_trace_is_a_message_not_an_exception(tmp_path: Path):
    frames = Frames()
    feed = run(LiveFeed(str(tmp_path / "nope.kvtrace"), frames, wait_s=0.2))
    assert feed.failed is not None and "no trace at" in feed.failed
    assert frames.last.ended == feed.failed


def test_corrupt_line_in_a_replay_names_the_line(tmp_path: Path, clean_trace: Path):
    lines = clean_trace.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(b"".join(lines[:50]) + b'{"kind": "write", "block": "oops"}\n' + b"".join(lines[50:]))
    frames = Frames()
    feed = run(ReplayFeed(str(bad), frames))  # a trace it cannot load ends the feed
    assert feed.failed is not None and ":51:" in feed.failed


@pytest.mark.parametrize("feed", [one_trace_feed, workload_feed], ids=["the demo's feed", "watch -- CMD's feed"])
def test_a_crashing_workload_is_reported_with_its_last_words_and_its_state_kept(tmp_path: Path, feed):
    # GIVEN a workload that writes two steps of a trace and then dies of an exception
    script = tmp_path / "crash.py"
    script.write_text(
        "import os\n"
        "from kvdoctor.trace import TraceWriter\n"
        "from kvdoctor.tui.synthetic import SyntheticWorkload\n"
        "w = SyntheticWorkload(num_steps=2)\n"
        "writer = TraceWriter(os.environ['KVDOCTOR_TRACE'], w.header())\n"
        "writer.write_many(list(w.events()))\n"
        "raise RuntimeError('the allocator exploded')\n"
    )
    workload = Workload([sys.executable, str(script)], workdir=str(tmp_path))
    frames = Frames()
    run(feed(workload, frames), timeout=90)
    # THEN the end says it crashed and why, and what it wrote is still shown
    assert frames.last.ended.startswith("workload crashed (exit 1)")
    assert "the allocator exploded" in frames.last.ended
    assert frames.last.num_events > 0 and frames.last.step >= 1


def test_a_command_that_writes_no_trace_says_so_with_how_it_ended(tmp_path: Path):
    # GIVEN `watch -- CMD` of a command that exits at once without building kvdoctor's engine
    workload = Workload([sys.executable, "-c", "raise SystemExit(3)"], workdir=str(tmp_path))
    frames = Frames()
    feed = run(workload_feed(workload, frames), timeout=90)
    # THEN the screen says no trace came, and how the command ended
    assert feed.failed is not None and "wrote no kvdoctor trace" in feed.failed and "exit 3" in feed.failed
    assert frames.last.ended == feed.failed


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_bug_in_a_check_stops_the_worker_with_a_message_not_a_hang(clean_trace: Path):
    class Broken:
        def observe(self, event):
            if event.step == 5:
                raise KeyError("no such block")
            return ()

        def finish(self):
            return ()

    frames = Frames()
    feed = run(LiveFeed(str(clean_trace), frames, checker_factory=lambda header: Broken()))
    assert feed.settled.is_set()
    assert frames.last.ended.startswith("kvdoctor's worker stopped: KeyError")
    assert frames.last.step >= 4  # what was seen before stays


def test_a_workload_that_lingers_after_closing_its_trace_is_reported_once_it_exits(tmp_path: Path):
    script = tmp_path / "slow_exit.py"
    script.write_text(
        "import os, time\n"
        "from kvdoctor.trace import TraceWriter\n"
        "from kvdoctor.tui.synthetic import SyntheticWorkload\n"
        "w = SyntheticWorkload(num_steps=3)\n"
        "with TraceWriter(os.environ['KVDOCTOR_TRACE'], w.header()) as writer:\n"
        "    writer.write_many(list(w.events()))\n"
        "time.sleep(3)\n"
    )
    workload = Workload([sys.executable, str(script)], workdir=str(tmp_path))
    frames = Frames()
    run(LiveFeed(str(workload.trace), frames, workload=workload, wait_s=60), timeout=90)
    assert any(f.status == "trace closed; waiting for the workload to exit" for f in frames.snapshots)
    assert frames.last.ended == "workload finished (exit 0)"
