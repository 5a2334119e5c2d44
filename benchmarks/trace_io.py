"""Trace I/O throughput: encode+write and read+decode of a realistic trace, in events/s.

The event mix follows a decode workload (per step: one batch, writes, reads, attention stats for
every layer, a usage per tier), so the figure is what a real trace costs, not a best case. Each
direction is timed several times and the median is reported, with a plain ``f.write`` of the same
bytes and a plain ``f.read`` as the in-run baselines the machine's noise applies to equally.

    .venv/bin/python benchmarks/trace_io.py [--events 1000000] [--repeats 5] [--gzip | --binary]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvdoctor import events as E
from kvdoctor.trace import TraceReader, TraceWriter

NUM_LAYERS = 30


def make_steps(num_events: int, batch: int = 8) -> list[list[E.Event]]:
    steps: list[list[E.Event]] = []
    total, step, t = 0, 0, 0
    while total < num_events:
        evs: list[E.Event] = [E.Batch(t=t, step=step, rows=list(range(batch)), positions=[step + 100] * batch,
                                      n=[1] * batch, shape=[batch, 3, 1, 64])]
        for seq in range(batch):
            block = seq * 1000 + (step + 100) // 16
            evs.append(E.Write(t=t, step=step, block=block, seq=seq, pos=step + 100, n=1, version=step + 101))
            evs.append(E.Read(t=t, step=step, seq=seq, blocks=list(range(seq * 1000, block + 1)),
                              versions=[step + 101] * (block + 1 - seq * 1000)))
            for layer in range(NUM_LAYERS):
                evs.append(E.Attn(t=t, step=step, seq=seq, layer=layer, max_logit=12.5, entropy=2.25,
                                  sink=0.31, nonfinite=0))
        for tier in E.TIERS:
            evs.append(E.Usage(t=t, step=step, tier=tier, used_blocks=100, capacity_blocks=512))
        evs.append(E.StepEnd(t=t, step=step, num_tokens=batch))
        steps.append(evs)
        total += len(evs)
        step, t = step + 1, t + 1000
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gzip", action="store_true")
    ap.add_argument("--binary", action="store_true", help="the msgpack encoding (run.kvtrace.msgpack)")
    args = ap.parse_args()

    steps = make_steps(args.events)
    n = sum(map(len, steps))
    header = E.Header(block_size=16, num_layers=NUM_LAYERS, tiers=[E.TierSpec(name=t, capacity_blocks=512) for t in E.TIERS])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("bench.kvtrace.gz" if args.gzip else "bench.kvtrace.msgpack" if args.binary else "bench.kvtrace")
        writes, reads, raw_writes, raw_reads, cpu_writes, cpu_reads = [], [], [], [], [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            with TraceWriter(path, header) as w:
                for evs in steps:
                    w.write_many(evs)
            writes.append(time.perf_counter() - t0)
            cpu_writes.append(time.process_time() - c0)

            t0, c0 = time.perf_counter(), time.process_time()
            count = sum(len(b) for b in TraceReader(path).batches())
            reads.append(time.perf_counter() - t0)
            cpu_reads.append(time.process_time() - c0)
            assert count == n + 1

            data = path.read_bytes()
            t0 = time.perf_counter()
            with open(Path(tmp) / "raw", "wb") as f:
                f.write(data)
            raw_writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(Path(tmp) / "raw", "rb") as f:
                while f.read(1 << 20):
                    pass
            raw_reads.append(time.perf_counter() - t0)
        size = path.stat().st_size

    w, r = statistics.median(writes), statistics.median(reads)
    cw, cr = statistics.median(cpu_writes), statistics.median(cpu_reads)
    print(f"events: {n:,} in {len(steps):,} steps, {size / n:.0f} bytes/event, file {size / 1e6:.1f} MB"
          f"{' (gzip)' if args.gzip else ' (msgpack)' if args.binary else ''}")
    # CPU time is the fairer clock on a shared machine: it leaves out time the process waited for a core.
    # The range shows how much the machine's noise moved the repeats around their median.
    print(f"encode+write: {n / w / 1e6:.2f} M events/s wall, {n / cw / 1e6:.2f} M per CPU-second "
          f"({_spread(n, cpu_writes)}; median of {args.repeats}; raw write of the same bytes "
          f"{size / statistics.median(raw_writes) / 1e9:.2f} GB/s)")
    print(f"read+decode:  {n / r / 1e6:.2f} M events/s wall, {n / cr / 1e6:.2f} M per CPU-second "
          f"({_spread(n, cpu_reads)}; median of {args.repeats}; raw read "
          f"{size / statistics.median(raw_reads) / 1e9:.2f} GB/s)")


def _spread(n: int, seconds: list[float]) -> str:
    return f"{n / max(seconds) / 1e6:.2f}-{n / min(seconds) / 1e6:.2f}"

if __name__ == "__main__":
    main()
