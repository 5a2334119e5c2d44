"""Cost of kvdoctor's checks: replay throughput over a recorded trace, and live cost in decoding.

1. **Replay.** A trace of at least ``--events`` events (default 1M) is recorded from the real
   engine: a ``PagedKVCache`` driven like a decode server (16 requests in flight, one token
   each per step, continuous arrivals and departures, preemption by swap to host and disk,
   forks, rollbacks) with a ``batch`` event per step and, since no model runs here, an ``attn``
   event per sequence and layer carrying plausible statistics. Then every check runs over it:
   from the file (decode + checks, what ``kvdoctor check --trace`` does) and over events
   already in memory (the checks alone). Goal: >= 500k events/s for the checks.
2. **Live.** Decode tokens/s of the runner (continuous batching, greedy, ``--batch`` rows of
   ``--new-tokens`` tokens) with every event emitted to a sink that does nothing, against the
   same with every check running in the engine's thread (``Session.on_bus``); runs alternate,
   the median of ``--repeats`` is reported, plus the time spent inside the checks as a share
   of decode time (robust to a noisy machine). Goal: <= 3 % slower. Events off (nobody
   listening: no attention statistics computed at all) is reported for reference.

Usage::

    .venv/bin/python benchmarks/checks.py [--events 1000000] [--model tiny|PATH] [--batch 8]
        [--new-tokens 64] [--repeats 5] [--trace FILE] [--skip-live] [--skip-replay] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

NUM_LAYERS = 8


def record(path: Path, num_events: int, seed: int = 0) -> int:
    """Drive the real cache like a decode server until the trace holds ``num_events`` events."""
    from kvdoctor.engine.kv.cache import PagedKVCache
    from kvdoctor.engine.config import EngineConfig
    from kvdoctor.engine.errors import OutOfBlocks
    from kvdoctor.events import Attn, Batch
    from kvdoctor.trace import TraceWriter

    rng = random.Random(seed)
    cfg = EngineConfig(num_layers=NUM_LAYERS, num_kv_heads=1, head_dim=4, block_size=16, dtype="float32",
                       device_blocks=96, host_blocks=256, disk_blocks=512, prefetch_depth=0)
    cache = PagedKVCache(cfg)
    writer = TraceWriter(path, cache.header())
    count = [0]

    def sink(events: list) -> None:
        count[0] += len(events)
        writer.write_many(events)

    cache.bus.subscribe(sink)
    bus = cache.bus
    live: dict[int, int] = {}
    swapped: set[int] = set()
    next_id = 0
    while count[0] < num_events:
        while len(live) < 16:
            seq, next_id = next_id, next_id + 1
            cache.add_sequence(seq, prompt_len=rng.randint(8, 200))
            live[seq] = rng.randint(16, 160)
        rows = [s for s in live if s not in swapped]
        bus.emit(Batch, rows=rows, positions=[cache.seq_len(s) or 0 for s in rows],
                 n=[1 if cache.seq_len(s) else cache.sequence(s).prompt_len for s in rows])
        for seq in rows:
            n = 1 if cache.seq_len(seq) else cache.sequence(seq).prompt_len
            try:
                cache.ensure_resident([seq])
                cache.reserve(seq, n)
                cache.commit(seq)
            except OutOfBlocks:
                cache.remove_sequence(seq, reason="aborted")
                del live[seq]
                continue
            cache.emit_read(seq)
            most = 0.9 * math.log(cache.seq_len(seq))  # what a query over this many keys can hold, with room
            for layer in range(NUM_LAYERS):
                bus.emit(Attn, seq=seq, layer=layer, max_logit=8.0 + layer + rng.gauss(0, 0.5),
                         entropy=min(most, 2.5 + rng.gauss(0, 0.2)), sink=0.3 + rng.uniform(-0.05, 0.05), nonfinite=0)
            live[seq] -= 1
            r = rng.random()
            if r < 0.01 and cache.seq_len(seq) > 2:
                cache.rollback(seq, 1)
            elif r < 0.015 and len(live) < 20:
                child, next_id = next_id, next_id + 1
                cache.fork(seq, child)
                live[child] = rng.randint(4, 32)
        # preemption by swap and resumption
        resident = [s for s in live if s not in swapped]
        if rng.random() < 0.05 and resident:
            victim = rng.choice(resident)
            cache.swap_out(cache.block_table(victim), dst=rng.choice(["host", "disk"]))
            swapped.add(victim)
        elif swapped and rng.random() < 0.2:
            swapped.discard(next(iter(swapped)))
        for seq in [s for s, left in live.items() if left <= 0]:
            cache.remove_sequence(seq)
            del live[seq]
            swapped.discard(seq)
        cache.end_step(len(rows))
    cache.close()
    writer.close()
    return count[0]


def replay(path: Path, repeats: int) -> dict[str, Any]:
    from kvdoctor.checks import make_suite
    from kvdoctor.trace import TraceReader

    t0 = time.perf_counter()
    reader = TraceReader(path)
    events = [ev for batch in reader.batches() for ev in batch]
    decode_s = time.perf_counter() - t0
    n = len(events)
    checks_s, checks_cpu_s, findings = [], [], None
    for _ in range(repeats):
        suite = make_suite()
        t0, c0 = time.perf_counter(), time.process_time()
        suite.observe_many(events)
        suite.finish()
        checks_s.append(time.perf_counter() - t0)
        checks_cpu_s.append(time.process_time() - c0)
        findings = len(suite.findings)
    best = min(checks_s)
    return {
        "events": n, "trace_mb": round(path.stat().st_size / 1e6, 1), "findings": findings,
        "kinds": dict(Counter(type(e).__struct_config__.tag for e in events).most_common()),
        "decode_events_per_s": round(n / decode_s),
        "checks_events_per_s": round(n / best),
        "checks_events_per_s_median": round(n / statistics.median(checks_s)),
        # CPU time of this process: what the checks cost, whatever else the machine runs
        "checks_events_per_cpu_s": round(n / min(checks_cpu_s)),
        "file_to_findings_events_per_s": round(n / (decode_s + best)),
    }


def live(model_arg: str | None, batch: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from decode import _prompts, runner_decode  # the decode benchmark's own measurement

    from kvdoctor.engine.model.model import load_model, tiny_llama
    from kvdoctor.engine.serving.runner import Runner
    from kvdoctor.session import Session

    lm = tiny_llama(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, intermediate_size=512,
                    max_position_embeddings=2048) if model_arg == "tiny" else load_model(model_arg)
    if lm.tokenizer is not None:
        prompts = _prompts(lm.tokenizer, [16 + 24 * i for i in range(batch)])
    else:
        rng = random.Random(0)
        prompts = [[rng.randrange(3, lm.config.vocab_size) for _ in range(16 + 24 * i)] for i in range(batch)]
    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, device_blocks=1024, host_blocks=0)
    inside = [0.0, 0.0]  # wall and CPU seconds spent in the checks during one run

    def null_sink(events: list) -> None:
        pass

    def off() -> float:
        return runner_decode(runner, prompts, new_tokens)

    def events_only() -> float:
        runner.bus.subscribe(null_sink)
        try:
            return runner_decode(runner, prompts, new_tokens)
        finally:
            runner.bus.unsubscribe(null_sink)

    def checked() -> float:
        session = Session(None)
        feed = session.feed

        def timed(events: list) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            feed(events)
            inside[0] += time.perf_counter() - t0
            inside[1] += time.thread_time() - c0

        runner.bus.subscribe(timed)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            rate = runner_decode(runner, prompts, new_tokens)
        finally:
            runner.bus.unsubscribe(timed)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert session.close() == [] and session.findings == [], [f.message for f in session.findings]
        shares.append(inside[0] / wall)
        cpu_shares.append(inside[1] / cpu)
        events.append(session.num_events)
        inside[:] = [0.0, 0.0]
        return rate

    shares: list[float] = []
    cpu_shares: list[float] = []
    events: list[int] = []
    runner_decode(runner, prompts[:1], 4)  # warm up
    runs: dict[str, list[float]] = {"events_off": [], "events_no_checks": [], "events_with_checks": []}
    for _ in range(repeats):
        runs["events_off"].append(off())
        runs["events_no_checks"].append(events_only())
        runs["events_with_checks"].append(checked())
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "model": lm.name, "batch": batch, "new_tokens": new_tokens, "repeats": repeats,
        "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
        "checks_slowdown_vs_events": round(1 - med["events_with_checks"] / med["events_no_checks"], 4),
        "events_per_run": events[-1],
        "checks_share_of_decode_time": round(statistics.median(shares), 4),
        "checks_share_of_decode_cpu": round(statistics.median(cpu_shares), 4),
        "slowdown_vs_events_off": round(1 - med["events_with_checks"] / med["events_off"], 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--trace", help="recorded trace to reuse (recorded here when missing)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help="'tiny' or a local checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-live", action="store_true")
    p.add_argument("--skip-replay", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    path = Path(args.trace or os.path.join(tempfile.mkdtemp(prefix="kvd-bench-"), "checks.kvtrace"))
    result: dict[str, Any] = {}
    if not args.skip_replay:
        if not path.exists():
            t0 = time.perf_counter()
            recorded = record(path, args.events)
            result["record_s"] = round(time.perf_counter() - t0, 1)
            print(f"recorded {recorded} events to {path} in {result['record_s']} s", file=sys.stderr)
        result["replay"] = replay(path, args.repeats)
        print(f"replay: {result['replay']}", file=sys.stderr)
    if not args.skip_live:
        result["live"] = live(args.model, args.batch, args.new_tokens, args.repeats)
        print(f"live: {result['live']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
