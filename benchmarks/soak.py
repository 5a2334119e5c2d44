"""Soak: does kvdoctor hold its memory flat over a long run?

Three soaks, each a subcommand:

``synthetic``
    A writer process writes a v1 trace of ``--events`` synthetic events (a serving workload:
    sequences come and go, swap out and back, abort, free; with ``--fresh-ids`` every block
    allocation takes an id never used before, as an engine without a pool would). Two
    consumers follow the file while it is written: the code of ``kvdoctor check --trace F
    --follow`` (``open_source`` + ``Session.run``) and the TUI's worker (``LiveFeed``, the
    code of ``kvdoctor watch --trace F``, publishing to nobody). Each samples its own RSS
    every ``--every`` events; growth is measured after ``--warmup`` events. The full soak of
    the issue is ``--events 50000000``.

        .venv/bin/python benchmarks/soak.py synthetic --events 2000000 --fresh-ids

``real``
    The embedded SmolLM2 demo (the engine's serving workload) writes its trace for
    ``--minutes``; ``kvdoctor check --trace F --follow`` and a headless TUI worker
    (``LiveFeed``, the code behind ``kvdoctor watch --trace F``) follow it at the same time.
    The RSS of both consumers is sampled every ``--sample-s`` seconds.

        .venv/bin/python benchmarks/soak.py real --minutes 22 --out /tmp/soak-real

``engine``
    kvdoctor's engine (tiny random Llama, small device tier so requests swap to host) serves
    ``--requests`` requests, keeping 8 in flight and aborting some while swapped out. Blocks in
    use per tier, arena bytes and the Python heap (tracemalloc) are compared before and after.

        .venv/bin/python benchmarks/soak.py engine --requests 2000
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of ``pid`` in MB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 1e6
    except (OSError, IndexError):
        return 0.0


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


# --- synthetic: a long stream through check --follow and the TUI's worker --------------------------------

def synthetic_workload(fresh_ids: bool = False, seed: int = 1) -> Any:
    from kvdoctor.tui.synthetic import SyntheticWorkload

    # The TUI's own workload: 8 requests in flight over 24 device blocks, so preemption by swap to
    # host happens every few steps, and aborts of swapped-out requests.
    return SyntheticWorkload(num_steps=1 << 40, seed=seed, fresh_ids=fresh_ids)


def write_synthetic(path: str, num_events: int, fresh_ids: bool) -> None:
    from kvdoctor.trace import TraceWriter

    workload = synthetic_workload(fresh_ids)
    events = workload.events()
    with TraceWriter(path, workload.header()) as writer:
        written = 0
        while written < num_events:
            chunk = list(itertools.islice(events, min(65536, num_events - written)))
            writer.write_many(chunk)
            written += len(chunk)


class RssLog:
    """RSS samples of this process every ``every`` events: (events, seconds, MB)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.next = 0
        self.t0 = time.monotonic()
        self.samples: list[tuple[int, float, float]] = []

    def at(self, num_events: int, *, last: bool = False) -> None:
        if num_events >= self.next or last:
            self.samples.append((num_events, time.monotonic() - self.t0, rss_mb()))
            self.next = (num_events // self.every + 1) * self.every


class _Sampled:
    """A source that samples RSS as its batches go by; everything else is the source's own."""

    def __init__(self, source: Any, log: RssLog) -> None:
        self._source, self._log = source, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def batches(self) -> Iterator[list[Any]]:
        n = 0
        for batch in self._source.batches():
            n += len(batch)
            self._log.at(n)
            yield batch


def consume(kind: str, path: str, every: int) -> dict[str, Any]:
    """Follow ``path`` as ``check --follow`` (kind "check") or the TUI's worker ("worker") does."""
    log = RssLog(every)
    log.at(0)
    if kind == "check":
        from kvdoctor.session import Session, open_source

        session = Session(_Sampled(open_source(path, follow=True, wait_s=60.0), log)).run()
        num_events, findings = session.num_events, [f"{f.check}/{f.rule}" for f in session.findings]
        state = _ledger_sizes(session.suite.ledger)
    else:
        from kvdoctor.tui.feed import LiveFeed

        feed = LiveFeed(path, lambda snap: log.at(snap.num_events), wait_s=60.0)
        feed.start()
        feed.join()
        m = feed.monitor
        num_events, findings = m.num_events, [f"{f.check}/{f.rule}" for f in m.findings]
        state = {"block_records": len(m.blocks.records), "cells": len(m.blocks.cells), "live_seqs": len(m.seqs),
                 "ended_seqs": len(m._ended), "log": len(m.log)}
    gc.collect()
    log.at(num_events, last=True)
    return {"kind": kind, "events": num_events, "seconds": time.monotonic() - log.t0, "findings": findings,
            "state": state, "samples": log.samples}


def _ledger_sizes(ledger: Any) -> dict[str, int]:
    return {"allocated": len(ledger.owners), "histories": len(ledger.hist), "freed_kept": len(ledger.freed),
            "live_seqs": len(ledger.seqs), "ended_kept": len(ledger.ended)}


def growth(samples: list[tuple[int, float, float]], warmup: int) -> tuple[float, float]:
    """(RSS at the first sample after ``warmup`` events, the largest RSS after it minus that)."""
    after = [s for s in samples if s[0] >= warmup] or samples[-1:]
    base = after[0][2]
    return base, max(s[2] for s in after) - base


def soak_synthetic(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "synthetic.kvtrace")
        me = [sys.executable, __file__]
        writer = subprocess.Popen(me + ["write", path, "--events", str(args.events)]
                                  + (["--fresh-ids"] if args.fresh_ids else []))
        consumers = {kind: subprocess.Popen(me + ["consume", kind, path, "--every", str(args.every)],
                                            stdout=subprocess.PIPE, text=True) for kind in ("check", "worker")}
        t0 = time.monotonic()
        results = {kind: json.loads(p.communicate()[0]) for kind, p in consumers.items()}
        writer.wait()
        wall = time.monotonic() - t0
        size = os.path.getsize(path) / 1e6
    print(f"# synthetic soak: {args.events:,} events{' (fresh block ids)' if args.fresh_ids else ''}, "
          f"trace {size:,.0f} MB, wall {wall:,.0f} s; CPU {cpu_model()}, {os.cpu_count()} cores; "
          f"load at end {load_average()}")
    for kind, r in results.items():
        base, grew = growth([tuple(s) for s in r["samples"]], args.warmup)
        print(f"\n## {kind}: {r['events']:,} events in {r['seconds']:,.0f} s ({r['events'] / r['seconds']:,.0f} events/s), "
              f"findings {sorted(set(r['findings'])) or 'none'}; RSS after {args.warmup:,} events {base:.1f} MB, "
              f"growth after it {grew:+.1f} MB; state at the end {r['state']}")
        print("events	seconds	rss_mb")
        for n, t, mb in r["samples"]:
            print(f"{n}	{t:.0f}	{mb:.1f}")


# --- engine: 2000 requests through kvdoctor's engine --------------------------------------------------------

def engine_state(runner: Any) -> dict[str, Any]:
    stats = runner.cache.stats()
    tiers = stats["tiers"]
    return {"blocks": stats["blocks"], "sequences": stats["sequences"],
            "used_blocks": {str(getattr(t, "value", t)): v["used_blocks"] for t, v in tiers.items()},
            "arena_bytes": sum(v["arena_bytes"] for v in tiers.values())}


def soak_engine(num_requests: int, *, seed: int = 0, checkpoint: int = 250, warmup: int = 50,
                on_checkpoint: Any = None, limits: Any = None, heap: bool = True, cycle: int = 0) -> dict[str, Any]:
    """Serve ``num_requests`` through the engine, 8 in flight, every check listening (under ``limits``,
    a ``kvdoctor.limits.Limits``). After ``warmup`` requests and every ``checkpoint`` requests the
    engine runs idle and its state is recorded (and handed to ``on_checkpoint`` as it comes), with
    the number of Python objects alive and (with ``heap``) the Python heap allocated since the warm-up
    and still alive: all of it, and the part the engine's own code allocated. With ``cycle`` the same
    ``cycle`` requests come round again and again (so do the tensor shapes they make): what the heap
    still gains then is not a per-shape cache settling but memory kept per request."""
    import random

    import torch

    from kvdoctor.config import Config
    from kvdoctor.engine.model.model import tiny_llama
    from kvdoctor.engine.serving.runner import Runner, SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler

    torch.manual_seed(seed)
    lm = tiny_llama(num_layers=2, max_position_embeddings=512)
    runner = Runner.create(lm.model, block_size=4, device_blocks=24, host_blocks=96)
    suite = (Config(limits=limits) if limits is not None else Config()).make_suite()
    runner.bus.subscribe(suite.observe_many)
    sched = Scheduler(runner, max_batch=8)
    rng = random.Random(seed)
    vocab = lm.config.vocab_size
    submitted = served = 0
    marks = sorted({warmup, *range(checkpoint, num_requests + 1, checkpoint), num_requests})
    checkpoints: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for mark in marks:
        while served < mark:
            while submitted < mark and len(sched.live) < 8:
                if cycle and submitted % cycle == 0:
                    rng.seed(seed)
                ids = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 20))]
                sched.submit(Request(ids, max_new_tokens=rng.randint(1, 12), sampling=SamplingParams(greedy=True)))
                submitted += 1
            sched.step()
            swapped = [seq for seq, live in sched.live.items() if live.state == "swapped"]
            if swapped and rng.random() < 0.05:
                sched.abort(rng.choice(swapped))
            served += len(sched.done)
            sched.done.clear()  # a server hands each finished generation to its client and forgets it
        runner.bus.flush()
        gc.collect()
        total = engine_heap = None
        if heap:
            if not tracemalloc.is_tracing():
                tracemalloc.start()  # from the warm-up on: tracing the imports and the model would cost more than the soak
            engine_dir = os.path.dirname(sys.modules[Runner.__module__].__file__) + os.sep
            total = tracemalloc.get_traced_memory()[0]
            engine_heap = sum(t.size for t in tracemalloc.take_snapshot().traces
                              if t.traceback[0].filename.startswith(engine_dir))
        checkpoints.append({"requests": served, "seconds": round(time.monotonic() - t0, 1),
                            "objects": len(gc.get_objects()), "heap": total, "engine_heap": engine_heap,
                            "rss_mb": round(rss_mb(), 1), **engine_state(runner)})
        if on_checkpoint is not None:
            on_checkpoint(checkpoints[-1])
    if heap:
        tracemalloc.stop()
    runner.close()
    suite.finish()
    return {"checkpoints": checkpoints, "findings": [f.message for f in suite.findings]}


# --- real: the SmolLM2 demo followed by check --follow and the TUI's worker -----------------------------

def run_worker(path: str) -> None:
    """The TUI's worker without a terminal: follow ``path``, check every event, drop the snapshots."""
    from kvdoctor.tui.feed import LiveFeed

    feed = LiveFeed(path, lambda snap: None, wait_s=120.0)
    feed.start()
    feed.join()
    m = feed.monitor
    print(f"worker: {m.num_events:,} events, {sum(m.num_findings.values())} findings", flush=True)


def soak_real(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"{args.model or 'smollm2'}.kvtrace"
    trace.unlink(missing_ok=True)
    env = dict(os.environ, KVDOCTOR_TRACE=str(trace))
    demo = subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, "-m", "kvdoctor.demo",
                             "--seconds", str(args.minutes * 60)] + (["--model", args.model] if args.model else []),
                            env=env,
                            stdout=subprocess.DEVNULL, stderr=open(out / "demo.log", "w"))
    kvdoctor = Path(sys.executable).with_name("kvdoctor")
    check = subprocess.Popen([str(kvdoctor), "check", "--trace", str(trace), "--follow", "--wait", "300",
                              "--format", "json", "-o", str(out / "report.json")],
                             stderr=open(out / "check.log", "w"))
    worker = subprocess.Popen([sys.executable, __file__, "worker", str(trace)],
                              stdout=open(out / "worker.log", "w"), stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    with open(out / "rss.tsv", "w") as log:
        log.write("elapsed_s\ttrace_mb\tcheck_rss_mb\tworker_rss_mb\tload\n")
        while check.poll() is None or worker.poll() is None:
            size = trace.stat().st_size / 1e6 if trace.exists() else 0.0
            log.write(f"{time.monotonic() - t0:.0f}\t{size:.1f}\t{rss_mb(check.pid):.1f}\t"
                      f"{rss_mb(worker.pid):.1f}\t{load_average()}\n")
            log.flush()
            time.sleep(args.sample_s)
    demo.wait()
    print(f"demo exit {demo.returncode}, check exit {check.returncode}, worker exit {worker.returncode}")
    print((out / "rss.tsv").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("real", help="the SmolLM2 demo under check --follow and the TUI's worker")
    r.add_argument("--minutes", type=float, default=22.0)
    r.add_argument("--sample-s", type=float, default=30.0)
    r.add_argument("--out", default="/tmp/kvdoctor-soak-real")
    r.add_argument("--model", help="the demo's model: 'tiny' for the small random one (default: SmolLM2)")
    r.add_argument("--nice", type=int, default=10, help="the demo's niceness (it shares the machine)")
    w = sub.add_parser("worker", help="(internal) the TUI's worker following one trace, headless")
    w.add_argument("trace")
    s = sub.add_parser("synthetic", help="a long synthetic stream through check --follow and the TUI's worker")
    s.add_argument("--events", type=int, default=2_000_000, help="the issue's full soak: 50000000")
    s.add_argument("--every", type=int, default=100_000, help="RSS sample interval, in events")
    s.add_argument("--warmup", type=int, default=200_000, help="events before growth is measured")
    s.add_argument("--fresh-ids", action="store_true", help="a new block id for every allocation")
    s.add_argument("--dir", default=None, help="where the trace is written (default: the system's temp dir)")
    wr = sub.add_parser("write", help="(internal) write the synthetic trace")
    wr.add_argument("trace")
    wr.add_argument("--events", type=int, required=True)
    wr.add_argument("--fresh-ids", action="store_true")
    c = sub.add_parser("consume", help="(internal) follow a trace as check or the TUI's worker; JSON on stdout")
    c.add_argument("kind", choices=("check", "worker"))
    c.add_argument("trace")
    c.add_argument("--every", type=int, required=True)
    e = sub.add_parser("engine", help="the engine under a soak of requests")
    e.add_argument("--requests", type=int, default=2000)
    e.add_argument("--checkpoint", type=int, default=250, help="record the state every this many requests")
    e.add_argument("--cycle", type=int, default=0, help="the same N requests again and again (0: all different)")
    e.add_argument("--ended-seqs", type=int, default=None, help="the checks' bound on ended sequences kept")
    args = p.parse_args()
    if args.mode == "real":
        soak_real(args)
    elif args.mode == "worker":
        run_worker(args.trace)
    elif args.mode == "synthetic":
        soak_synthetic(args)
    elif args.mode == "write":
        write_synthetic(args.trace, args.events, args.fresh_ids)
    elif args.mode == "consume":
        print(json.dumps(consume(args.kind, args.trace, args.every)))
    elif args.mode == "engine":
        print("requests\tseconds\tblocks\tsequences\tused_blocks\tarena_bytes\tobjects\tpy_heap_B\tengine_heap_B\trss_mb",
              flush=True)
        from kvdoctor.limits import Limits

        limits = Limits(ended_seqs=args.ended_seqs) if args.ended_seqs is not None else None
        r = soak_engine(args.requests, checkpoint=args.checkpoint, limits=limits, cycle=args.cycle, on_checkpoint=lambda c: print(
            f"{c['requests']}\t{c['seconds']}\t{c['blocks']}\t{c['sequences']}\t{c['used_blocks']}\t"
            f"{c['arena_bytes']}\t{c['objects']}\t{c['heap']}\t{c['engine_heap']}\t{c['rss_mb']}", flush=True))
        cps = r["checkpoints"]
        print(f"# engine soak: {cps[-1]['requests']} requests in {cps[-1]['seconds']:.0f} s; CPU {cpu_model()}; "
              f"load {load_average()}; Python heap allocated since the warm-up and alive at the end "
              f"{cps[-1]['heap']:,} B, by the engine's code {cps[-1]['engine_heap']:,} B")
        print(f"findings: {len(r['findings'])}")


if __name__ == "__main__":
    main()
