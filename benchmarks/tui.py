"""How fast the TUI's worker keeps up: events per second through the state model and the feed.

Writes a synthetic trace of at least ``--events`` events (default 1M; a serving workload
with swaps, aborts and a leak fault, see ``kvdoctor.tui.synthetic``), then measures

1. the state model alone (``Monitor.observe`` over decoded events),
2. the whole worker (``LiveFeed``: follow the file, decode, run every check, fold into the
   monitor, publish snapshots at 15 frames/s to a consumer that drops them), with checks,
3. the same without checks, to show what the checks cost.

The goal is >= 50k events/s for (2). Run:

    .venv/bin/python benchmarks/tui.py [--events 1000000]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time
from pathlib import Path

from kvdoctor.trace import TraceReader, TraceWriter
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1_000_000)
    args = p.parse_args()
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
