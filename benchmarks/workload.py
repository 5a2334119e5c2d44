"""Checking a workload of several traces: merged throughput and peak memory of ``kvdoctor check --trace DIR``.

One trace of ``--events`` events is recorded from the real engine driven like a decode server
(``benchmarks/checks.py``'s ``record``: 16 requests in flight, preemption by swap, forks, rollbacks,
attention statistics), then copied ``--traces`` times as the tensor-parallel ranks of one instance (a
header with ``instance``, ``tp_rank``, ``tp_size`` and a wall-clock ``t0`` a millisecond apart), so the
ranks agree and the rules across traces compare every step's decisions of every rank (the heaviest
merge: allocation, frees and batches of all ranks go through it). Each measurement runs in a fresh
process, which reports its wall and CPU time and its peak resident memory (``VmHWM``):

- ``one trace``: the single trace, as ``kvdoctor check --trace FILE`` reads it (the baseline);
- ``workload``: every copy, as ``kvdoctor check --trace DIR`` reads them: each trace checked on its own by a
  worker process (one per CPU), merged by wall-clock time for the rules across traces;
- ``1 process``: the same in one process (``WorkloadSession(workers=1)``, as traces still being written are).

Each case prints wall events/s, events per CPU-second (the process's and its workers' CPU time: what a loaded
machine still measures fairly) and peak memory: the process's peak resident set plus, with workers, as many
times the largest worker's peak as run at once (an upper bound: pages a forked worker shares count twice).

With ``--floor``, also what bounds a faster check: ``read``, the single trace read and decoded with nothing
checked (the floor of one process), and ``split``, the copies' per-trace checks (no rules across traces) in
two processes at once, half the traces each (what checking traces in parallel processes could gain at most).

With ``--follow``, also ``kvdoctor check --trace DIR --follow`` while one writer process per rank writes its
copy live, batch by batch, as fast as it can, and with ``--write-rate N`` also at N events/s each (an engine's
pace): whether the check keeps up (how long after the last writer it ends). Followed traces are checked in the
checking process itself, never by workers.

    .venv/bin/python benchmarks/workload.py [--events 2000000] [--traces 8] [--follow [--write-rate N]] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_workload(directory: Path, events: int, traces: int) -> list[Path]:
    """The recorded trace and ``traces`` rank copies of it in ``directory``."""
    from checks import record

    from kvdoctor.events import Header, encode

    import msgspec

    source = directory / "recorded.kvtrace"
    record(source, events)
    paths = []
    with open(source, "rb") as f:
        header = msgspec.json.decode(f.readline(), type=Header)
        body = f.tell()
    t0 = time.time_ns()
    for rank in range(traces):
        path = directory / "ranks" / f"rank{rank}.kvtrace"
        path.parent.mkdir(exist_ok=True)
        tagged = msgspec.structs.replace(header, instance="bench", tp_rank=rank, tp_size=traces, t0=t0 + rank * 1_000_000)
        with open(source, "rb") as src, open(path, "wb") as dst:
            src.seek(body)
            dst.write(encode(tagged) + b"\n")
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        paths.append(path)
    return [source, *paths]


def measure(paths: list[str], workers: int | None = None) -> dict:
    """Check ``paths`` as one workload from this process (``workers``: as ``WorkloadSession`` takes it): events/s,
    CPU time with the workers', and peak memory with the workers'."""
    from kvdoctor.workload import TraceSet, WorkloadSession

    t0, c0 = time.perf_counter(), time.process_time()
    session = WorkloadSession(TraceSet.open(paths, follow=False), workers=workers).run()
    wall = time.perf_counter() - t0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = time.process_time() - c0
    cpu = own + children.ru_utime + children.ru_stime
    pool = session._pool
    at_once = pool.workers if pool is not None else 0
    peak = _peak_rss_mb() + at_once * round(children.ru_maxrss / 1024, 1)
    return {"traces": len(session.members), "workers": at_once, "events": session.num_events, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "merge_cpu_s": round(own, 2), "events_per_s": round(session.num_events / wall),
            "events_per_cpu_s": round(session.num_events / cpu), "peak_rss_mb": round(peak, 1),
            "findings": len(session.findings)}


def read_only(paths: list[str]) -> dict:
    """Read and decode ``paths`` with nothing checked: the floor of a check in one process."""
    from kvdoctor.session import TraceSource

    t0, c0, n = time.perf_counter(), time.process_time(), 0
    for path in paths:
        for batch in TraceSource(path).batches():
            n += len(batch)
    return _rates(n, t0, c0)


def per_trace(paths: list[str]) -> dict:
    """Every check of each of ``paths`` on its own, as ``kvdoctor check --trace FILE`` runs them, one after
    another in this process (no rules across traces)."""
    from kvdoctor.session import Session, TraceSource

    t0, c0, n = time.perf_counter(), time.process_time(), 0
    for path in paths:
        n += Session(TraceSource(path)).run().num_events
    return _rates(n, t0, c0)


def _rates(events: int, t0: float, c0: float) -> dict:
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"events": events, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "events_per_s": round(events / wall),
            "events_per_cpu_s": round(events / cpu)}


def split(ranks: list[Path], processes: int = 2) -> dict:
    """The per-trace checks of ``ranks`` in ``processes`` processes at once: events/s over the wall time of all."""
    t0 = time.perf_counter()
    parts = [ranks[i::processes] for i in range(processes)]
    children = [subprocess.Popen([sys.executable, __file__, "--per-trace", *map(str, part)], stdout=subprocess.PIPE,
                                 text=True) for part in parts]
    results = [json.loads(c.communicate()[0]) for c in children]
    wall = time.perf_counter() - t0
    events = sum(r["events"] for r in results)
    return {"processes": processes, "events": events, "wall_s": round(wall, 2), "events_per_s": round(events / wall)}


def write_live(source: str, target: str, rate: float = 0.0) -> None:
    """Write ``source``'s events to ``target`` batch by batch (a live engine's trace): as fast as a writer can, or
    at ``rate`` events/s."""
    from kvdoctor.trace import TraceReader, TraceWriter

    reader = TraceReader(source)
    start, written = time.perf_counter(), 0
    with TraceWriter(target, msgspec_replace_pid(reader.header)) as writer:
        for batch in reader.batches():
            writer.write_many([e for e in batch if type(e).__name__ != "TraceEnd"])
            written += len(batch)
            if rate:
                time.sleep(max(0.0, start + written / rate - time.perf_counter()))


def msgspec_replace_pid(header: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(header, pid=os.getpid())


def follow(ranks: list[Path], directory: Path, rate: float = 0.0) -> dict:
    """``kvdoctor check --trace DIR --follow`` while one writer process per rank writes its trace there live (as
    fast as it can, or ``rate`` events/s each): the check's events/s and how long after the last writer finished
    it ended (its lag)."""
    live = directory / f"live-{rate:g}"
    live.mkdir()
    check = subprocess.Popen([sys.executable, "-m", "kvdoctor.cli", "check", "--trace", str(live), "--follow",
                              "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = time.perf_counter()
    writers = [subprocess.Popen([sys.executable, __file__, "--write", str(p), str(live / p.name), str(rate)])
               for p in ranks]
    for w in writers:
        w.wait()
    written = time.perf_counter()
    out, _ = check.communicate()
    done = time.perf_counter()
    events = json.loads(out)["summary"]["events"]
    return {"traces": len(ranks), "rate": rate, "events": events, "writers_s": round(written - t0, 2),
            "check_s": round(done - t0, 2), "lag_s": round(done - written, 2), "events_per_s": round(events / (done - t0))}


def _peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM, which starts afresh at exec (``ru_maxrss`` carries the
    parent's peak across fork and exec: here the recording engine's)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return round(kb / 1024, 1)


def _in_child(paths: list[Path], workers: int | None = None) -> dict:
    extra = ["--workers", str(workers)] if workers is not None else []
    before = os.getloadavg()[0]
    out = subprocess.run([sys.executable, __file__, *extra, "--measure", *map(str, paths)], check=True,
                         capture_output=True, text=True)
    return {**json.loads(out.stdout), "load": [round(before, 1), round(os.getloadavg()[0], 1)]}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=2_000_000, help="events per trace (default 2M)")
    ap.add_argument("--traces", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--follow", action="store_true",
                    help="also: check --follow while one live writer process per trace writes it")
    ap.add_argument("--floor", action="store_true",
                    help="also: the trace read and decoded alone, and the per-trace checks split over 2 processes")
    ap.add_argument("--measure", nargs="+", metavar="TRACE", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--read-only", nargs="+", metavar="TRACE", help=argparse.SUPPRESS)
    ap.add_argument("--per-trace", nargs="+", metavar="TRACE", help=argparse.SUPPRESS)
    ap.add_argument("--write-rate", type=float, default=0.0, metavar="N",
                    help="with --follow, also with each writer writing N events/s (an engine's pace)")
    ap.add_argument("--write", nargs=3, metavar=("SRC", "DST", "RATE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.workers)))
        return 0
    if args.write:
        write_live(args.write[0], args.write[1], float(args.write[2]))
        return 0
    if args.read_only or args.per_trace:
        print(json.dumps(read_only(args.read_only) if args.read_only else per_trace(args.per_trace)))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvdoctor-bench-workload-") as tmp:
        t0 = time.perf_counter()
        source, *ranks = make_workload(Path(tmp), args.events, args.traces)
        recorded_s = time.perf_counter() - t0
        result = {"cpu": _cpu(), "load": os.getloadavg()[0], "recorded_s": round(recorded_s, 1),
                  "trace_mb": round(source.stat().st_size / 1e6, 1),
                  "one_trace": _in_child([source]), "workload": _in_child([ranks[0].parent]),
                  "one_process": _in_child([ranks[0].parent], workers=1)}
        if args.floor:
            result["read"] = json.loads(subprocess.run([sys.executable, __file__, "--read-only", str(source)],
                                                       check=True, capture_output=True, text=True).stdout)
            result["split"] = split(ranks)
        if args.follow:
            result["follow"] = [follow(ranks, Path(tmp))]
            if args.write_rate:
                result["follow"].append(follow(ranks, Path(tmp), args.write_rate))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"CPU {result['cpu']}, load {result['load']:.1f}; a trace of {result['one_trace']['events']} events "
          f"({result['trace_mb']} MB) recorded in {result['recorded_s']} s")
    for r in result.get("follow", []):
        pace = f"{r['rate'] / 1e3:g}k events/s each" if r["rate"] else "as fast as they can"
        print(f"follow     {r['traces']} live writers ({pace}), {r['events']} events: writers done in "
              f"{r['writers_s']} s, the check {r['lag_s']} s later ({r['events_per_s'] / 1e3:.0f}k events/s)")
    if "read" in result:
        r, sp = result["read"], result["split"]
        print(f"read       1 trace, {r['events']} events read and decoded, nothing checked: "
              f"{r['events_per_s'] / 1e3:.0f}k events/s wall, {r['events_per_cpu_s'] / 1e3:.0f}k per CPU-second")
        print(f"split      {len(ranks)} traces' own checks in {sp['processes']} processes at once (no rules across "
              f"traces): {sp['events_per_s'] / 1e3:.0f}k events/s wall")
    for name, title in (("one_trace", "one trace"), ("workload", "workload"), ("one_process", "1 process")):
        r = result[name]
        how = f"{r['workers']} workers" if r["workers"] else "in-process"
        print(f"{title:10} {r['traces']} trace(s), {r['events']} events, {how}: {r['events_per_s'] / 1e3:.0f}k events/s "
              f"wall, {r['events_per_cpu_s'] / 1e3:.0f}k per CPU-second, peak RSS {r['peak_rss_mb']} MB, "
              f"{r['findings']} findings (load {r['load'][0]}-{r['load'][1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
