"""What the memory probes cost: per reading, and as a share of decode throughput.

    .venv/bin/python benchmarks/probes.py                      # per-reading costs + SmolLM2 decode on/off
    .venv/bin/python benchmarks/probes.py --model tiny         # a tiny random Llama (seconds)
    .venv/bin/python benchmarks/probes.py --readings-only

Decode runs alternate probes off / on, in ABBA order (same model, same prompts, greedy,
a trace being written in both), so drift on a shared machine hits both sides alike; the figure is the
median tokens/s of each side and their ratio. The goal is on/off >= 0.98 at the
default interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kvdoctor.probes import DEFAULT_INTERVAL_S, attach_to_cache  # noqa: E402
from kvdoctor.probes.heap import HeapProbe  # noqa: E402
from kvdoctor.probes.nvml import Nvml  # noqa: E402
from kvdoctor.probes.prober import Prober  # noqa: E402
from kvdoctor.probes.rss import RssProbe  # noqa: E402
from kvdoctor.probes.torch_mem import CudaAllocator, cache_accounting  # noqa: E402


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    """Median of 5 batches of n calls, in microseconds per call."""
    fn()
    batches = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        batches.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(batches)


class _NullBus:
    def emit(self, *_: Any, **__: Any) -> None:
        pass


def reading_costs(cache: Any, n: int) -> dict[str, float | None]:
    """Microseconds per reading of each probe; tracemalloc is off except for the last three."""
    rss, cuda, nvml = RssProbe(), CudaAllocator(), Nvml()
    prober = Prober(_NullBus(), cache_accounting(cache))
    costs: dict[str, float | None] = {
        "rss": per_call_us(rss.read, n),
        "engine accounting (cache.stats)": per_call_us(cache_accounting(cache), n),
        "torch.cuda allocated/reserved": per_call_us(cuda.read, n) if cuda.available else None,
        "nvml (device + process)": per_call_us(nvml.read, max(1, n // 10)) if nvml.available else None,
        "full reading (Prober.take)": per_call_us(prober.take, n),
    }
    prober.close()
    heap = HeapProbe()
    with_heap = Prober(_NullBus(), cache_accounting(cache), heap=True)
    costs["py_heap (tracemalloc counter)"] = per_call_us(heap.read, n)
    costs["full reading, tracemalloc on"] = per_call_us(with_heap.take, n)
    costs["heap snapshot (attribution, on demand)"] = per_call_us(heap.snapshot, 3)
    with_heap.close()
    heap.close()
    rss.close()
    nvml.close()
    return costs


def load(model_name: str, device: str) -> tuple[Any, list[list[int]]]:
    import torch

    from kvdoctor.engine.model.model import load_model, tiny_llama

    if model_name == "tiny":
        loaded = tiny_llama()
        prompts = [[1, *range(5 + i, 37 + i)] for i in range(4)]
    else:
        loaded = load_model(dtype="float32" if device == "cpu" else "float16", device=device)
        text = "The key-value cache of a transformer stores"
        prompts = [loaded.tokenizer.encode(f"{text} ({i})") for i in range(4)]
    torch.set_grad_enabled(False)
    return loaded.model.to(device), prompts


@dataclass(frozen=True)
class Rate:
    wall: float  # decode tokens per wall-clock second
    cpu: float  # decode tokens per CPU second of this process (robust to other load on the machine)
    num_mem: int
    probe_share: float  # the probes' own time (Prober.total_ns) over the run's wall time


def decode_rate(model: Any, prompts: list[list[int]], tokens: int, probes: dict[str, Any] | None,
                trace_dir: str) -> Rate:
    """Decode throughput of one run (the prefill step excluded), and how many mem events it had."""
    from kvdoctor.engine.bus import Bus
    from kvdoctor.engine.serving.runner import Runner
    from kvdoctor.events import Mem, StepEnd
    from kvdoctor.trace import TraceWriter

    bus = Bus()
    runner = Runner.create(model, bus=bus, device_blocks=256, host_blocks=256)
    marks: list[tuple[float, float, int]] = []  # (wall s, process CPU s, tokens) at every step end
    num_mem = 0

    def meter(events: list) -> None:
        nonlocal num_mem
        for e in events:
            if type(e) is StepEnd:
                marks.append((time.perf_counter(), time.process_time(), e.num_tokens))
            elif type(e) is Mem:
                num_mem += 1

    with TraceWriter(Path(trace_dir) / "bench.kvtrace", runner.cache.header()) as writer:
        bus.subscribe(writer.write_many)
        bus.subscribe(meter)
        prober = attach_to_cache(runner.cache, **probes) if probes is not None else None
        t0 = time.perf_counter()
        runner.generate(prompts, max_new_tokens=tokens, max_batch=len(prompts))
        elapsed = time.perf_counter() - t0
        if prober is not None:
            prober.detach()
    runner.close()
    decode = marks[1:]  # the first step is the prefill
    tokens_decoded = sum(n for _, _, n in decode)
    wall, cpu = decode[-1][0] - marks[0][0], decode[-1][1] - marks[0][1]
    share = prober.total_ns / 1e9 / elapsed if prober is not None else 0.0
    return Rate(wall=tokens_decoded / wall, cpu=tokens_decoded / cpu, num_mem=num_mem, probe_share=share)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt (4 prompts, one batch)")
    ap.add_argument("--rounds", type=int, default=5, help="off/on pairs")
    ap.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S)
    ap.add_argument("--heap", action="store_true", help="probes with tracemalloc (py_heap, attribution)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier on a shared machine)")
    ap.add_argument("--readings-only", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    model, prompts = load(args.model, args.device)
    from kvdoctor.engine.serving.runner import Runner

    with Runner.create(model, device_blocks=64, host_blocks=64) as runner:
        runner.generate(prompts[:2], max_new_tokens=8)  # a cache with something in it
        costs = reading_costs(runner.cache, 2000)
    result: dict[str, Any] = {"model": args.model, "device": args.device, "reading_us": costs}
    if not args.readings_only:
        probes = {"interval_s": args.interval, "heap": args.heap}
        off: list[Rate] = []
        on: list[Rate] = []
        with tempfile.TemporaryDirectory() as tmp:
            decode_rate(model, prompts, 4, None, tmp)  # warm-up
            for i in range(args.rounds):
                # off-on, on-off, ...: whatever favours the first or second run of a pair cancels out
                for arm in ((None, off), (probes, on))[:: 1 if i % 2 == 0 else -1]:
                    arm[1].append(decode_rate(model, prompts, args.tokens, arm[0], tmp))
        med = {f"{side}_{k}": statistics.median(getattr(r, k) for r in runs)
               for side, runs in (("off", off), ("on", on)) for k in ("wall", "cpu")}
        result["decode"] = {
            "tokens_per_prompt": args.tokens, "batch": len(prompts), "rounds": args.rounds, "threads": args.threads,
            **probes, **med,
            "ratio_wall": med["on_wall"] / med["off_wall"], "ratio_cpu": med["on_cpu"] / med["off_cpu"],
            "mem_events_per_run": statistics.median(r.num_mem for r in on),
            "probe_time_share": statistics.median(r.probe_share for r in on),
        }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"per reading ({args.model} on {args.device}), microseconds:")
    for name, us in costs.items():
        print(f"  {name:<40} {'n/a' if us is None else f'{us:9.1f}'}")
    if "decode" in result:
        d = result["decode"]
        print(f"decode, {d['batch']} x {d['tokens_per_prompt']} tokens, {d['rounds']} rounds, {d['threads']} thread(s), "
              f"interval {d['interval_s']} s, tracemalloc {'on' if d['heap'] else 'off'} "
              f"({d['mem_events_per_run']:.0f} mem events per run):")
        print(f"  per wall second: off {d['off_wall']:.1f} tok/s, on {d['on_wall']:.1f} tok/s, ratio {d['ratio_wall']:.3f}")
        print(f"  per CPU second:  off {d['off_cpu']:.1f} tok/s, on {d['on_cpu']:.1f} tok/s, ratio {d['ratio_cpu']:.3f}")
        print(f"  time spent in readings: {100 * d['probe_time_share']:.3f}% of the run (noise-free bound on the cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
