"""A workload kvdoctor starts never outlives it: whatever ends kvdoctor (SIGHUP, SIGTERM, SIGINT,
a crash, SIGKILL), the workload and every process in its group are gone within 5 s, and the
trace it wrote still reads (closed, or cut at a line). The workload here is a small Python
script (no torch), so each case costs about a second; the demo's own parent watch uses the
tiny model."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.child import TracedChild
from kvdoctor.trace import TraceReader

TESTS = str(Path(__file__).parent)
GONE_WITHIN_S = 5.0

# Writes one step of events every 20 ms forever, with a grandchild (`sleep`) in its process group;
# tells the test its pid, the grandchild's and its trace once the first step is on disk.
# (A job started in the background by a non-interactive shell inherits SIGINT ignored, and so would
# this workload: it takes Ctrl-C back, as an interactive Python program has it.)
WORKLOAD = """
import json, os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from check_traces import HEADER, request
from kvdoctor.trace import TraceWriter
grandchild = subprocess.Popen(["sleep", "300"])
w = TraceWriter(os.environ["KVDOCTOR_TRACE"], HEADER)
step = 0
try:
    while True:
        w.write_many(request(f"r{{step}}", step, step=step))
        if step == 0:
            with open({pids!r} + ".tmp", "w") as f:
                json.dump({{"workload": os.getpid(), "grandchild": grandchild.pid,
                           "trace": os.environ["KVDOCTOR_TRACE"]}}, f)
            os.replace({pids!r} + ".tmp", {pids!r})
        step += 1
        time.sleep(0.02)
except KeyboardInterrupt:  # Ctrl-C, as kvdoctor's stop() sends first: close the trace
    w.close()
"""

# A parent that starts the workload through TracedChild, then crashes (an uncaught exception:
# no stop(), no finally of ours) once the workload is running.
CRASHING_PARENT = """
import os, sys, time
from kvdoctor.child import TracedChild
child = TracedChild([sys.executable, "-c", {workload!r}], {trace!r})
while not os.path.exists({pids!r}):
    time.sleep(0.02)
raise RuntimeError("the TUI crashed")
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is gone for our purpose: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_file(path: Path, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> Any:
    """The JSON ``path`` holds once it appears (its writers rename it into place whole), while ``proc``, where
    given, still runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc is None or proc.poll() is None, f"the parent exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return json.loads(path.read_text())


def _gone(pids: list[int], timeout: float = GONE_WITHIN_S) -> list[int]:
    """The pids still running after ``timeout`` s (empty: all gone in time)."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _reads(trace: str) -> tuple[int, bool]:
    """(events, truncated) of a trace; raises if it does not read."""
    reader = TraceReader(trace)
    return sum(len(b) for b in reader.batches()), reader.truncated


def _ctrl_c_works() -> None:
    """kvdoctor as started from a terminal: SIGINT not ignored, even when the tests run as a background job."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def started(tmp_path):
    """Starts a parent process; on teardown kills whatever the test left running (by pid)."""
    procs: list[subprocess.Popen] = []
    leftovers: list[int] = []

    def start(argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "parent.err", "wb"), start_new_session=True,
                                preexec_fn=_ctrl_c_works)
        procs.append(proc)
        return proc

    start.leftovers = leftovers
    yield start
    for pid in leftovers + [p.pid for p in procs]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait(5)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_check_workload_and_its_group_stop_when_kvdoctor_is_signalled(tmp_path, started, sig):
    # GIVEN `kvdoctor check -- python workload.py`, the workload running with a child of its own
    pids_file = tmp_path / "pids.json"
    workload = WORKLOAD.format(tests=TESTS, pids=str(pids_file))
    parent = started([sys.executable, "-m", "kvdoctor.cli", "check", "--", sys.executable, "-c", workload])
    pids = _wait_file(pids_file, parent)
    started.leftovers += [pids["workload"], pids["grandchild"]]
    time.sleep(0.1)  # a few steps on disk
    # WHEN kvdoctor gets the signal
    parent.send_signal(sig)
    # THEN the workload and its grandchild are gone within 5 s, and so is kvdoctor
    assert _gone([pids["workload"], pids["grandchild"]]) == []
    parent.wait(GONE_WITHIN_S)
    # AND the trace reads: every step written before the cut (a cut mid-line is a truncation, not an error)
    if sig == signal.SIGKILL:  # nothing of kvdoctor's ran: its temporary directory is still there
        num_events, _ = _reads(pids["trace"])
        assert num_events >= 8  # at least the first whole step
    else:  # kvdoctor stopped it, reported what it checked and cleaned up after itself
        assert not Path(pids["trace"]).exists()
        assert parent.returncode == -sig if sig != signal.SIGINT else parent.returncode in (0, 1)
        assert "Traceback" not in (tmp_path / "parent.err").read_text()


def test_a_crashed_parent_leaves_no_workload(tmp_path, started):
    # GIVEN a parent (a TUI, say) that started a workload through TracedChild
    pids_file = tmp_path / "pids.json"
    trace = str(tmp_path / "w.kvtrace")
    workload = WORKLOAD.format(tests=TESTS, pids=str(pids_file))
    parent = started([sys.executable, "-c", CRASHING_PARENT.format(workload=workload, trace=trace, pids=str(pids_file))])
    pids = _wait_file(pids_file, parent)
    started.leftovers += [pids["workload"], pids["grandchild"]]
    # WHEN it crashes without stopping it
    assert parent.wait(30) == 1
    # THEN the workload and its grandchild are stopped within 5 s, and the trace reads
    assert _gone([pids["workload"], pids["grandchild"]]) == []
    assert _reads(trace)[0] >= 8


def test_stop_ends_the_whole_group_and_releases_the_guard(tmp_path):
    # GIVEN a workload with a grandchild, started in this process
    pids_file = tmp_path / "pids.json"
    trace = str(tmp_path / "w.kvtrace")
    child = TracedChild([sys.executable, "-c", WORKLOAD.format(tests=TESTS, pids=str(pids_file))], trace)
    pids = _wait_file(pids_file)
    # WHEN it is stopped
    child.stop()
    # THEN both processes are gone, the workload closed its trace on the Ctrl-C it got first,
    # and the guard exited on its own
    assert _gone([pids["workload"], pids["grandchild"]], 0.5) == []
    assert child.stopped and child.returncode == 0
    assert _reads(trace)[1] is False
    assert child._guard.proc.poll() == 0


def test_a_workload_that_ends_on_its_own_keeps_its_exit_status(tmp_path):
    # GIVEN a workload that exits 0 by itself WHEN kvdoctor then stops it (as close() does)
    child = TracedChild([sys.executable, "-c", "pass"], str(tmp_path / "w.kvtrace"))
    assert child.wait(30) == 0
    child.stop()
    # THEN nothing was signalled: its own exit stands
    assert child.exit_message() == "workload finished (exit 0)"
    assert child._guard.proc.poll() == 0


DEMO_PARENT = """
import os, subprocess, sys
demo = subprocess.Popen([sys.executable, "-m", "kvdoctor.demo", "--model", "tiny"],
                        env=dict(os.environ, KVDOCTOR_TRACE={trace!r}))
print(demo.pid, flush=True)
sys.stdin.read()  # until the test kills us
"""


def test_the_demo_stops_on_its_own_when_its_parent_is_gone(tmp_path, started):
    # GIVEN the demo (tiny model) started by a plain parent, with no guard of kvdoctor's
    trace = tmp_path / "demo.kvtrace"
    parent = subprocess.Popen([sys.executable, "-c", DEMO_PARENT.format(trace=str(trace))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    demo_pid = int(parent.stdout.readline())
    started.leftovers.append(demo_pid)
    deadline = time.monotonic() + 60
    while not (trace.exists() and trace.stat().st_size > 4096):  # serving: steps are on disk
        assert time.monotonic() < deadline and _alive(demo_pid), "the demo never served"
        time.sleep(0.1)
    # WHEN its parent is SIGKILLed
    parent.kill()
    parent.wait(5)
    # THEN the demo notices within 5 s, stops, and closes its trace
    assert _gone([demo_pid]) == []
    reader = TraceReader(trace)
    events = [e for batch in reader.batches() for e in batch]
    assert not reader.truncated and type(events[-1]).__name__ == "TraceEnd"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("how", ["close-terminal", signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=lambda h: h if isinstance(h, str) else signal.Signals(h).name)
def test_the_workload_of_watch_stops_however_the_tui_ends(tmp_path, started, how):
    # GIVEN `kvdoctor watch -- python workload.py` in a terminal (a tmux server of the test's own)
    pids_file = tmp_path / "pids.json"
    workload = WORKLOAD.format(tests=TESTS, pids=str(pids_file))
    server = f"kvdoctor-test-{uuid.uuid4().hex[:8]}"
    command = shlex.join([sys.executable, "-m", "kvdoctor.cli", "watch", "--", sys.executable, "-c", workload])
    tmux = started(["tmux", "-L", server, "new-session", "-d", "-x", "100", "-y", "30", command])
    tmux.wait(30)
    try:
        pids = _wait_file(pids_file, timeout=60)
        started.leftovers += [pids["workload"], pids["grandchild"]]
        # WHEN the terminal goes away (every process in it gets SIGHUP), or the TUI gets a signal
        if how == "close-terminal":
            subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True, timeout=30)
        else:
            with open(f"/proc/{pids['workload']}/stat") as f:
                tui = int(f.read().rsplit(")", 1)[1].split()[1])  # the workload's parent: kvdoctor watch
            os.kill(tui, how)
        # THEN the workload and its grandchild are gone within 5 s
        assert _gone([pids["workload"], pids["grandchild"]]) == []
    finally:
        subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True, timeout=30)


# Ignores SIGINT, SIGTERM and SIGHUP: only SIGKILL ends it.
STUBBORN = """
import os, signal, time
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
with open({pids!r} + ".tmp", "w") as f:  # whole or absent: the waiters test only that it exists
    f.write(str(os.getpid()))
os.replace({pids!r} + ".tmp", {pids!r})
time.sleep(300)
"""

STUBBORN_PARENT = """
import os, sys, time
from kvdoctor.child import TracedChild
TracedChild([sys.executable, "-c", {workload!r}], {trace!r})
while not os.path.exists({pids!r}):
    time.sleep(0.02)
print("ready", flush=True)
time.sleep(300)
"""


def test_a_workload_that_ignores_every_polite_signal_is_still_stopped(tmp_path, started):
    # GIVEN a workload that ignores SIGINT, SIGTERM and SIGHUP
    pids_file = tmp_path / "pid"
    workload = STUBBORN.format(pids=str(pids_file))
    child = TracedChild([sys.executable, "-c", workload], str(tmp_path / "a.kvtrace"))
    _wait_file(pids_file)
    # WHEN kvdoctor stops it THEN it escalates to SIGKILL
    child.stop(timeout=0.3)
    assert child.returncode == -signal.SIGKILL
    # GIVEN the same workload under a parent WHEN the parent is SIGKILLed
    pids_file.unlink()
    parent = subprocess.Popen([sys.executable, "-c", STUBBORN_PARENT.format(workload=workload, pids=str(pids_file),
                                                                            trace=str(tmp_path / "b.kvtrace"))],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout.readline() == "ready\n"
    pid = int(pids_file.read_text())
    started.leftovers.append(pid)
    parent.kill()
    parent.wait(5)
    # THEN the guard's SIGTERM does nothing, and its SIGKILL 3 s later ends it, within 5 s
    assert _gone([pid]) == []
