"""What recording the user's stack (``kvdoctor.callsite.user_stack``) costs a decode step.

Producers walk the stack on ``seq_start``, a sequence's first ``alloc`` and ``seq_end``: per sequence,
not per token. Timing generate with and without the walks would measure the machine's load, not the
walks (a few microseconds against tens of milliseconds), so this counts the walks instead: it runs
``generate`` of the embedded SmolLM2 (or ``--tiny``) at each batch size under the transformers observer
and on kvdoctor's engine (``EngineCache``, its bus listened to), times every walk
(thread CPU time) and the whole call, and reports the walks per call, the median walk, and the walks'
share of the call, i.e. of its decode steps, after a first call that warmed the cache of verdicts (its
walks' time is reported apart: once per process). ``--depth`` also times one walk under that many library
frames (the cache of verdicts per code object warm, as in a long-running server). Usage::

    .venv/bin/python benchmarks/stacks.py [--batches 1 8] [--new-tokens 32] [--depth 60] [--tiny] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

import kvdoctor
from kvdoctor import callsite
from kvdoctor.callsite import user_stack
from kvdoctor.engine.model.hf import EngineCache
from kvdoctor.engine.model.model import load_model, tiny_llama

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Explain gravity to a child in one sentence.", "Translate 'good morning' into Spanish.",
           "What is 12 times 7?", "Name a colour of the rainbow.", "Say hello."]


class _TimedWalks:
    """Replaces ``callsite.user_stack``, which every producer calls through its module, with one that times each
    walk (thread CPU ns)."""

    def __init__(self) -> None:
        self.times: list[int] = []

    def __call__(self) -> list[str] | None:
        start = time.thread_time_ns()
        frames = user_stack()
        self.times.append(time.thread_time_ns() - start)
        return frames

    def __enter__(self) -> "_TimedWalks":
        callsite.user_stack = self
        return self

    def __exit__(self, *exc: object) -> None:
        callsite.user_stack = user_stack


def _inputs(model, tok, batch: int) -> dict:
    if tok is None:  # --tiny: random prompts of 5, 8, 11 ... tokens, left-padded
        lengths = [5 + 3 * i for i in range(batch)]
        ids = torch.zeros(batch, max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, -n:] = torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(i))
            mask[i, -n:] = 1
        return {"input_ids": ids, "attention_mask": mask}
    tok.padding_side = "left"
    return dict(tok(PROMPTS[:batch], return_tensors="pt", padding=True))


def _row(batch: int, steps: int, walks: list[int], cpu: int, wall: int) -> dict:
    return {
        "batch": batch, "steps": steps, "walks": len(walks),
        "walk_us_median": statistics.median(walks) / 1e3 if walks else 0.0,
        "walks_us_total": sum(walks) / 1e3, "call_ms_cpu": cpu / 1e6, "call_ms_wall": wall / 1e6,
        "step_ms_cpu": cpu / 1e6 / steps, "share_of_steps": sum(walks) / cpu,
    }


def engine_generate(model, tok, batch: int, new_tokens: int) -> dict:
    """``generate`` on kvdoctor's engine (``EngineCache``) with a listener on its bus, so events (and walks) are on."""
    inputs = _inputs(model, tok, batch)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=(tok.pad_token_id if tok is not None else None) or 0)
    with _TimedWalks() as walks:
        with EngineCache(model, device_blocks=64 * batch) as cache:
            cache.bus.subscribe(lambda events: None)
            start_cpu, start = time.thread_time_ns(), time.perf_counter_ns()
            model.generate(**inputs, cache=cache, **options)
            cache.finish()
            cpu, wall = time.thread_time_ns() - start_cpu, time.perf_counter_ns() - start
    return _row(batch, new_tokens, walks.times, cpu, wall)


def observed_generate(model, tok, batch: int, new_tokens: int, directory: str) -> dict:
    inputs = _inputs(model, tok, batch)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=(tok.pad_token_id if tok is not None else None) or 0)
    model.generate(**inputs, **options)  # warm
    with _TimedWalks() as walks:
        start_cpu, start = time.thread_time_ns(), time.perf_counter_ns()
        with kvdoctor.observe(model, trace=os.path.join(directory, f"b{batch}.kvtrace")):
            model.generate(**inputs, **options)
        cpu, wall = time.thread_time_ns() - start_cpu, time.perf_counter_ns() - start
    return _row(batch, new_tokens, walks.times, cpu, wall)  # one forward pass (decode step) per new token


def deep_walk(depth: int, repeats: int = 2000) -> dict:
    """One walk under ``depth`` frames of library code (compiled as a file in site-packages)."""
    library = Path(sysconfig.get_paths()["purelib"]) / "somelib" / "layers.py"
    scope: dict = {"user_stack": user_stack}
    exec(compile("def down(n):\n    return down(n - 1) if n else walk()\n", str(library), "exec"), scope)
    times: list[int] = []

    def walk() -> None:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            user_stack()
            times.append(time.perf_counter_ns() - start)

    scope["walk"] = walk
    scope["down"](depth)
    return {"depth": depth, "walk_us_median": statistics.median(times) / 1e3,
            "walk_us_p90": sorted(times)[int(0.9 * len(times))] / 1e3}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--depth", type=int, default=60)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tiny:
        loaded = tiny_llama(num_layers=4, seed=0)
    else:
        loaded = load_model()
    with tempfile.TemporaryDirectory() as directory:
        # the first calls classify every code object on the way (a path lookup each): once per process
        cold = [observed_generate(loaded.model, loaded.tokenizer, 1, 2, directory),
                engine_generate(loaded.model, loaded.tokenizer, 1, 2)]
        rows = [observed_generate(loaded.model, loaded.tokenizer, b, args.new_tokens, directory) for b in args.batches]
    engine = [engine_generate(loaded.model, loaded.tokenizer, b, args.new_tokens) for b in args.batches]
    result = {"cpu": _cpu_name(), "threads": args.threads, "first_walks_us": sum(r["walks_us_total"] for r in cold),
              "observer": rows, "engine": engine, "deep": deep_walk(args.depth)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['cpu']}, torch on {args.threads} thread(s)")
    print("producer      batch  steps  walks  walk µs (median)  walks µs  step ms (CPU)  walks' share of the steps")
    for producer, table in (("observer", rows), ("EngineCache", engine)):
        for r in table:
            print(f"{producer:12}  {r['batch']:5}  {r['steps']:5}  {r['walks']:5}  {r['walk_us_median']:16.1f}  "
                  f"{r['walks_us_total']:8.1f}  {r['step_ms_cpu']:13.2f}  {100 * r['share_of_steps']:.4f}%")
    print(f"the process's first calls (one per producer): {result['first_walks_us']:.0f} µs in their walks (once)")
    d = result["deep"]
    print(f"one walk under {d['depth']} library frames: {d['walk_us_median']:.1f} µs median, {d['walk_us_p90']:.1f} µs p90")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
