"""How fast the TUI's worker keeps up: events per second through the state model and the feed.

Writes a synthetic trace of at least ``--events`` events (default 1M; a serving workload
with swaps, aborts and a leak fault, see ``kvdoctor.tui.synthetic``), then measures

1. the state model alone (``Monitor.observe`` over decoded events),
2. the whole worker (``LiveFeed``: follow the file, decode, run every check, fold into the
   monitor, publish snapshots at 15 frames/s to a consumer that drops them), with checks,
3. the same without checks, to show what the checks cost.

The goal is >= 50k events/s for (2). With ``--keys N``, instead, how fast the screen answers keys while the
workload it watches competes for the CPU (issue 36's goal: within 200 ms): ``kvdoctor watch --demo``'s app
(headless, the real app and feed) over the SmolLM2 demo in its child process, beside ``--loops`` single-threaded
busy loops; every ``--interval`` seconds a key of ``--key-list`` (by default the tabs 1-5 in turn, as a user
looks around; ``p`` pauses and resumes) is sent as the terminal sends it, and timed until its action ran
(``handled``) and until the screen after it was painted (``painted``: what the user waits for). Median, 95th
percentile and worst of each, and where a key's wait went: the UI thread's CPU, its wait for a CPU, and the rest
(Linux's schedstat). The loops run in the TUI's session, as jobs started from the same shell, so that Linux's
autogroup gives the three of them one session's share of the CPU; ``--loops-apart`` starts each in a session of
its own, as a job from another terminal or a service. Run:

    .venv/bin/python benchmarks/tui.py [--events 1000000]
    .venv/bin/python benchmarks/tui.py --keys 40 [--loops 2] [--loops-apart] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvdoctor.trace import TraceReader, TraceWriter
from kvdoctor.tui.app import KvdoctorApp
from kvdoctor.tui.feed import LiveFeed, all_checks
from kvdoctor.tui.state import Monitor, Snapshot
from kvdoctor.tui.synthetic import SyntheticWorkload


def write_trace(path: Path, num_events: int) -> int:
    w = SyntheticWorkload(num_steps=1 << 40, fault="leak-swapped", seed=1)
    n = 0
    with TraceWriter(path, w.header()) as writer:
        events = w.events()
        while n < num_events:
            chunk = list(itertools.islice(events, min(65536, num_events - n)))
            if not chunk:
                break
            writer.write_many(chunk)
            n += len(chunk)
    return n


def bench_monitor(path: Path) -> tuple[int, float]:
    reader = TraceReader(path)
    events = [ev for batch in reader.batches() for ev in batch]
    monitor = Monitor(reader.header)
    observe = monitor.observe
    t0 = time.perf_counter()
    for ev in events:
        observe(ev)
    monitor.snapshot()
    return len(events), time.perf_counter() - t0


def bench_feed(path: Path, checks: bool) -> tuple[int, float, int, int]:
    frames = 0
    done = threading.Event()

    def publish(snap: Snapshot) -> None:
        nonlocal frames
        frames += 1

    feed = LiveFeed(str(path), publish, checker_factory=all_checks if checks else (lambda h: None))
    t0 = time.perf_counter()
    feed.start()
    feed.join()
    elapsed = time.perf_counter() - t0
    done.set()
    num_findings = sum(feed.monitor.num_findings.values())
    return feed.monitor.num_events, elapsed, frames, num_findings


def _sched(native_id: int | None) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of a thread of this process so far (Linux schedstat)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            run, wait, _ = f.read().split()
        return int(run), int(wait)
    except (OSError, ValueError, TypeError):
        return 0, 0


class _TimedApp(KvdoctorApp):
    """The real app, noting when each key's action ran and when the screen after it was painted, and the
    schedstat of the UI thread and the feed's at the paint."""

    CSS_PATH = str(Path(sys.modules[KvdoctorApp.__module__].__file__ or "").with_name("app.tcss"))  # the app's

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.marks: list[tuple[float, float, tuple[int, int, int, int]]] = []
        self.marked = asyncio.Event()  # set with each mark: the key's waiter sleeps until then, polling nothing

    def clocks(self) -> tuple[int, int, int, int]:
        """The UI thread's and the feed thread's (run, wait) ns."""
        feed = self.feed.native_id if self.feed is not None else None
        return (*_sched(threading.get_native_id()), *_sched(feed))

    async def run_action(self, action: Any, *args: Any, **kwargs: Any) -> bool:
        done = await super().run_action(action, *args, **kwargs)
        handled = time.perf_counter()
        self.call_after_refresh(self._mark, handled)
        return done

    def _mark(self, handled: float) -> None:
        self.marks.append((handled, time.perf_counter(), self.clocks()))
        self.marked.set()


async def _press_keys(keys: str, presses: int, interval: float) -> list[tuple[float, float, tuple[float, ...]]]:
    """(handled, painted) seconds after sending each key, over the demo once it serves."""
    from kvdoctor.tui.workload import Workload

    with tempfile.TemporaryDirectory() as workdir:
        workload = Workload.demo(seconds=900, workdir=workdir)
        try:
            app = _TimedApp(lambda publish: LiveFeed(str(workload.trace), publish, workload=workload, wait_s=600),
                            workload=workload, show_pid=False)
            async with app.run_test(size=(120, 36)) as pilot:
                waited = time.monotonic()
                while app.snapshot is None or app.snapshot.step < 5:  # the model loads, the first steps run
                    assert time.monotonic() - waited < 300, "the demo served no step in 300 s"
                    await pilot.pause(0.2)
                waits = [await _time_key(app, keys[i % len(keys)], interval) for i in range(presses)]
                await pilot.press("q")
        finally:
            workload.stop()
    return waits


async def _time_key(app: _TimedApp, key: str, rest: float) -> tuple[float, float, tuple[float, ...]]:
    """Send ``key`` as the terminal's driver posts one; (handled, painted) seconds after, and until the paint the
    UI thread's seconds on a CPU and waiting for one, the feed thread's the same; then ``rest`` seconds."""
    from textual import events

    app.marked.clear()
    before = app.clocks()
    sent = time.perf_counter()
    app._driver.send_message(events.Key(key, key))
    try:
        await asyncio.wait_for(app.marked.wait(), 60)
    except asyncio.TimeoutError:
        raise AssertionError(f"key {key!r} not answered in 60 s") from None
    handled, painted, after = app.marks[-1]
    await asyncio.sleep(rest)
    return handled - sent, painted - sent, tuple((a - b) / 1e9 for a, b in zip(after, before))


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"median {statistics.median(ordered) * 1e3:.0f} ms, p95 {p95 * 1e3:.0f} ms, worst {ordered[-1] * 1e3:.0f} ms"


def _loops_apart(n: int) -> Any:
    """``contention.BusyLoops`` whose loops each start a session of their own, as a job in another terminal or a
    service does: Linux's autogroup then shares the CPU between the sessions before their processes, and the TUI
    no longer splits its own session's share with them (``bench_keys``)."""
    from contention import _SPIN, BusyLoops

    class Apart(BusyLoops):
        def __enter__(self) -> BusyLoops:
            self.procs = [subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True) for _ in range(n)]
            return self

    return Apart(n)


def bench_keys(keys: str, presses: int, loops: int, interval: float, apart: bool, raw: Path | None) -> None:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    print(f"CPU {cpu} ({os.cpu_count()} CPUs), load {os.getloadavg()[0]:.1f} before; the demo on SmolLM2 beside "
          f"{loops} busy loop(s) ({'each in a session of its own' if apart else 'in the TUI session'}), a key every "
          f"{interval} s, keys {keys!r} in turn")
    from contention import BusyLoops  # this folder is the script's: on the path

    with (_loops_apart if apart else BusyLoops)(loops):
        waits = asyncio.run(_press_keys(keys, presses, interval))
    print(f"{len(waits)} keys, load {os.getloadavg()[0]:.1f} after")
    if raw is not None:  # every key, to pool several runs
        fields = ("handled", "painted", "ui_cpu", "ui_wait_cpu", "feed_cpu", "feed_wait_cpu")
        raw.write_text(json.dumps([dict(zip(("key", *fields), (keys[i % len(keys)], h, p, *c)))
                                   for i, (h, p, c) in enumerate(waits)]))
    print(f"handled: {_spread([h for h, _, _ in waits])}")
    print(f"painted: {_spread([p for _, p, _ in waits])}")
    if len(set(keys)) > 1:  # a slow screen shows apart from the others
        for key in dict.fromkeys(keys):
            painted = sorted(p for i, (_, p, _) in enumerate(waits) if keys[i % len(keys)] == key)
            print(f"  key {key}: painted {', '.join(f'{p * 1e3:.0f}' for p in painted)} ms")
    # Where a key's wait goes: the UI thread's own CPU, its wait for a CPU (the load), and the rest of the time
    # it was off the run queue (the GIL the feed holds, or the event loop's own timers); the feed's CPU meanwhile.
    print("until painted, ms (UI thread on a CPU / waiting for a CPU / neither; feed thread on a CPU):")
    for label, rows in (("medians", [statistics.median(column) for column in zip(*[(p, *c) for _, p, c in waits])]),
                        *((f"key of {p * 1e3:.0f}", [p, *c]) for _, p, c in sorted(waits, key=lambda w: w[1])[-3:])):
        painted, ui_run, ui_wait, feed_run, _ = rows
        print(f"  {label}: {ui_run * 1e3:.0f} / {ui_wait * 1e3:.0f} / {(painted - ui_run - ui_wait) * 1e3:.0f}; "
              f"feed {feed_run * 1e3:.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--keys", type=int, metavar="N", help="time N keys over the live demo instead (see above)")
    p.add_argument("--loops", type=int, default=2, help="with --keys: busy loops beside the demo (default 2)")
    p.add_argument("--loops-apart", action="store_true",
                   help="with --keys: each busy loop in a session of its own (default: in the TUI's, as a job "
                        "started from the same shell)")
    p.add_argument("--raw", type=Path, metavar="FILE", help="with --keys: every key's times (s) as JSON, to pool runs")
    p.add_argument("--interval", type=float, default=0.5, help="with --keys: seconds between keys (default 0.5)")
    p.add_argument("--key-list", default="12345",
                   help="with --keys: the keys pressed in turn (default 12345, the tabs; p pauses and resumes)")
    args = p.parse_args()
    if args.keys:
        bench_keys(args.key_list, args.keys, args.loops, args.interval, args.loops_apart, args.raw)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.kvtrace"
        t0 = time.perf_counter()
        n = write_trace(path, args.events)
        print(f"synthetic trace: {n:,} events, {path.stat().st_size / 1e6:.0f} MB, written in {time.perf_counter() - t0:.1f} s")
        n, dt = bench_monitor(path)
        print(f"state model alone:          {n / dt:>10,.0f} events/s  ({n:,} events in {dt:.2f} s)")
        for checks in (True, False):
            n, dt, frames, found = bench_feed(path, checks)
            label = "worker, with all checks:" if checks else "worker, without checks:"
            print(f"{label:<27} {n / dt:>10,.0f} events/s  ({n:,} events in {dt:.2f} s, "
                  f"{frames} snapshots, {found} findings)")


if __name__ == "__main__":
    main()
