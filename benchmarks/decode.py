"""Decode throughput: kvdoctor's runner against transformers' ``generate`` with its default cache.

Same model (the embedded SmolLM2-135M-Instruct unless ``--model``), same process,
greedy decoding of ``--new-tokens`` tokens per row, end-of-sequence ignored so every
run decodes the same number of tokens:

- batch 1: one prompt;
- batch 8: eight prompts of different lengths, continuously batched by the runner and
  left-padded into one batch for transformers;
- the runner with events off (nobody listening: no statistics, no trace) and with
  every event, attention statistics included, written to a trace file.

Decode tokens/s counts the tokens generated after the first one, over the time after
the first token (prefill excluded), by the wall clock and by this process's CPU time
(the fairer clock on a shared machine with ``--threads 1``). Runs alternate and
repeat; the median is reported with the peak RSS of the process. Usage::

    .venv/bin/python benchmarks/decode.py [--new-tokens 64] [--repeats 3] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

_TEXT = (
    "The history of computing is a story of layers: transistors make gates, gates make adders and memories, "
    "memories and adders make processors, and processors run the programs that people write to solve problems "
    "in science, business and daily life. Each layer hides the details of the one below it, which lets engineers "
    "build large systems without keeping every detail in mind at once. Caches are a good example of this idea."
)


def _prompts(tokenizer: Any, lengths: list[int]) -> list[list[int]]:
    ids = tokenizer(_TEXT)["input_ids"]
    while len(ids) < max(lengths):
        ids = ids + ids
    return [ids[:n] for n in lengths]


def _clocks() -> tuple[float, float]:
    """(wall, CPU) seconds. CPU time of this process is the fairer clock on a shared machine with
    one torch thread: it does not count the time other processes held the core."""
    return time.perf_counter(), time.process_time()


def _rates(tokens: int, start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clocks()
    return tokens / (wall - start[0]), tokens / (cpu - start[1])


class _FirstToken:
    """A logits processor that only notes when transformers finished its prefill."""

    def __init__(self) -> None:
        self.t: tuple[float, float] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.t is None:
            self.t = _clocks()
        return scores


def hf_decode(model: Any, prompts: list[list[int]], new_tokens: list[int], pad_id: int) -> tuple[float, float]:
    """Decode tokens/s (wall, CPU) of ``model.generate`` with its default cache on a left-padded batch.

    A static batch runs every row for the longest budget; only each row's own budget counts as output."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    first = _FirstToken()
    longest = max(new_tokens)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                         do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([first]))
    rates = _rates(sum(n - 1 for n in new_tokens), first.t)
    assert out.shape[1] == width + longest
    return rates


def runner_decode(runner: Any, prompts: list[list[int]], new_tokens: list[int]) -> tuple[float, float]:
    """Decode tokens/s (wall, CPU) of the runner with continuous batching over the unpadded prompts."""
    from kvdoctor.engine.scheduler import Request, Scheduler

    sched = Scheduler(runner, max_batch=len(prompts))
    for p, n in zip(prompts, new_tokens):
        sched.submit(Request(p, max_new_tokens=n, ignore_eos=True))
    sched.step()  # every prompt's prefill and first token
    t0 = _clocks()
    sched.run()
    rates = _rates(sum(n - 1 for n in new_tokens), t0)
    assert sorted(len(g.token_ids) for g in sched.done.values()) == sorted(new_tokens)
    return rates


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local checkpoint directory (default: the embedded SmolLM2)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batch-lengths", default="24,40,56,72,88,104,120,136",
                    help="prompt lengths of the batch-8 run (comma separated)")
    ap.add_argument("--mixed-outputs", action="store_true",
                    help="also run batch 8 with different output budgets per request (continuous batching's case)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvdoctor.engine.model import load_model
    from kvdoctor.engine.runner import Runner
    from kvdoctor.trace import TraceWriter

    lm = load_model(args.model)
    model, tok = lm.model, lm.tokenizer
    lengths = [int(x) for x in args.batch_lengths.split(",")]
    batch8 = _prompts(tok, lengths)
    batch1 = [batch8[len(batch8) // 2]]
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.config.eos_token_id
    runner = Runner.create(model, tokenizer=tok, device_blocks=512, host_blocks=0)
    trace_path = os.path.join(tempfile.mkdtemp(prefix="kvd-bench-"), "decode.kvtrace")

    def events_on(fn: Callable[[], tuple[float, float]]) -> tuple[float, float]:
        writer = TraceWriter(trace_path, runner.cache.header())
        runner.bus.subscribe(writer.write_many)
        try:
            return fn()
        finally:
            runner.bus.unsubscribe(writer.write_many)
            writer.close()

    cases: dict[str, dict[str, Callable[[], tuple[float, float]]]] = {}
    N = args.new_tokens
    # The last case gives the eight requests different output budgets (N/4 … N), as a server sees them:
    # the runner's batch shrinks as requests finish, a static batch keeps computing finished rows.
    mixed = [max(2, N * (i + 2) // 9) for i in range(len(batch8))]
    scenarios = [("batch1", batch1, [N]), ("batch8", batch8, [N] * len(batch8))]
    if args.mixed_outputs:
        scenarios.append(("batch8_mixed_outputs", batch8, mixed))
    for name, prompts, budgets in scenarios:
        cases[name] = {
            "transformers": lambda p=prompts, b=budgets: hf_decode(model, p, b, pad),
            "runner_events_off": lambda p=prompts, b=budgets: runner_decode(runner, p, b),
            "runner_events_on": lambda p=prompts, b=budgets: events_on(lambda: runner_decode(runner, p, b)),
        }
    # Warm both paths once (allocator, kernels) before timing anything.
    hf_decode(model, batch1, [4], pad)
    runner_decode(runner, batch1, [4])
    results: dict[str, Any] = {"model": lm.name, "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
                               "repeats": args.repeats, "batch8_prompt_lengths": lengths}
    for name, fns in cases.items():
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():  # alternate, so drifting machine load hits every variant alike
                runs[k].append(fn())
        for clock, i in (("wall", 0), ("cpu", 1)):
            med = {k: _median([r[i] for r in v]) for k, v in runs.items()}
            results[f"{name}_{clock}"] = {
                "tokens_per_s": {k: round(v, 2) for k, v in med.items()},
                "runs": {k: [round(r[i], 2) for r in v] for k, v in runs.items()},
                "speedup": round(med["runner_events_off"] / med["transformers"], 3),
                "events_overhead": round(1 - med["runner_events_on"] / med["runner_events_off"], 4),
            }
    results["trace_bytes"] = os.path.getsize(trace_path)
    results["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    runner.close()
    if args.json:
        print(json.dumps(results))
    else:
        for name in cases:
            for clock in ("wall", "cpu"):
                r = results[f"{name}_{clock}"]
                t = r["tokens_per_s"]
                print(f"{name} ({clock} clock): transformers {t['transformers']:.2f} tok/s, runner "
                      f"{t['runner_events_off']:.2f} tok/s ({r['speedup']:.2f}x), events on "
                      f"{t['runner_events_on']:.2f} tok/s (overhead {100 * r['events_overhead']:.1f}%)")
        print(f"peak RSS {results['peak_rss_mb']} MB, threads {results['threads']}, new tokens {args.new_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
