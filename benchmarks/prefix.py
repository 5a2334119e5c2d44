"""Prefix cache benchmark: time to first token and decode speed with and without the engine's prefix cache.

    .venv/bin/python benchmarks/prefix.py                  # SmolLM2-135M, 8 requests a round, 2 rounds, 1 thread
    .venv/bin/python benchmarks/prefix.py --tiny --quick   # a small random Llama, for a smoke test
    .venv/bin/python benchmarks/prefix.py --json out.json

The workload is a chat service: every request opens with the same long system prompt (at least 200
tokens) and asks its own short question, one request after another (batch 1). Each round runs the
same requests on a fresh engine without and then with the prefix cache (the order alternating from
round to round, so drift of a noisy machine falls on both), and reports per mode:

- TTFT: the first step of each request (prefill, or prefill of the uncached rest, and the first token),
  median over the requests after the first (the first finds an empty cache in both modes);
- decode tokens/s: the request's other tokens over the time they took;
- with the prefix cache, the share of prompt tokens served from it (all requests, the first included).

The greedy tokens of every request must be identical in both modes; the benchmark fails if not.
Goals (issue 12): >= 80% of prompt tokens served from the cache, TTFT <= 0.3x without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from kvdoctor.demo import SYSTEM_PROMPT
from kvdoctor.engine.model.model import load_model, tiny_llama
from kvdoctor.engine.serving.runner import Runner, SamplingParams
from kvdoctor.engine.serving.scheduler import Request, Scheduler

# The demo's system prompt and house rules: over 200 SmolLM2 tokens in the chat template.
RULES = (
    " House rules: never invent a benchmark number; quote units with every figure; when a question is about "
    "a crash, ask for the exact error message and the versions of the driver, the runtime and the model; when "
    "it is about memory, separate weights, activations and the KV cache, and say which of them grows with the "
    "batch and which with the context; when it is about latency, separate time to first token from the time "
    "between tokens; and when you recommend a setting, say what it costs. If a question mixes several "
    "problems, answer them one at a time, in the order asked. Prefer commands that can be pasted into a "
    "shell as they are, and name the file a setting lives in. Do not recommend upgrading hardware before the "
    "configuration has been checked, and never suggest turning a safety check off to make a number look better."
)
QUESTIONS = (
    "What is a KV cache?", "Why does my server run out of memory at long contexts?",
    "How does paged attention avoid fragmentation?", "What does prefix caching save?",
    "When should I swap KV blocks to host memory?", "Why is the first token slower than the rest?",
    "How do I size the batch for a 24 GB card?", "What is speculative decoding?",
    "Why do two identical prompts give different outputs when sampling?", "What is continuous batching?",
    "How do rotary embeddings affect caching?", "What does quantizing the KV cache to int8 cost in quality?",
)


def workload(runner: Runner, tiny: bool, num: int) -> list[list[int]]:
    """``num`` prompts sharing one system prompt of at least 200 tokens."""
    if tiny:
        import random

        rng = random.Random(0)
        vocab = runner.model.config.vocab_size
        system = [rng.randrange(3, vocab) for _ in range(240)]
        return [system + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 16))] for _ in range(num)]
    prompts = [runner.encode(QUESTIONS[i % len(QUESTIONS)], chat=True, system=SYSTEM_PROMPT + RULES) for i in range(num)]
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
    if shared < 200:
        raise SystemExit(f"the shared system prompt is {shared} tokens; the benchmark needs >= 200")
    return prompts


def run_mode(loaded: Any, prompts: list[list[int]], new_tokens: int, prefix: bool, block_size: int) -> dict[str, Any]:
    """The requests one after another on a fresh engine: per request TTFT, decode time and tokens."""
    runner = Runner.create(loaded.model, tokenizer=loaded.tokenizer, block_size=block_size,
                           device_blocks=4 * (len(prompts[0]) + new_tokens) // block_size + 64, host_blocks=0,
                           stats_every=0, prefix_cache=prefix)
    sched = Scheduler(runner, max_batch=1)
    ttft, decode_s, tokens = [], [], []
    try:
        for ids in prompts:
            seq = sched.submit(Request(ids, max_new_tokens=new_tokens, ignore_eos=True, sampling=SamplingParams()))
            t0 = time.perf_counter()
            sched.step()
            t1 = time.perf_counter()
            sched.run()
            t2 = time.perf_counter()
            ttft.append(t1 - t0)
            decode_s.append(t2 - t1)
            tokens.append(sched.done[seq].token_ids)
        stats = runner.cache.stats().get("prefix")
    finally:
        runner.close()
    return {"ttft": ttft, "decode_s": decode_s, "tokens": tokens, "prefix": stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2")
    ap.add_argument("--quick", action="store_true", help="4 requests of 8 tokens, 1 round")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine more threads wait on each other)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", metavar="FILE", help="also write the result here")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests, a.new_tokens, a.rounds = 4, 8, 1
    torch.set_num_threads(a.threads)
    loaded = tiny_llama(vocab_size=512, max_position_embeddings=4096) if a.tiny else load_model(None)
    probe = Runner.create(loaded.model, tokenizer=loaded.tokenizer, block_size=a.block_size, stats_every=0)
    prompts = workload(probe, a.tiny, a.requests)
    probe.close()
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for r in range(a.rounds):
        for prefix in ((False, True) if r % 2 == 0 else (True, False)):
            runs[prefix].append(run_mode(loaded, prompts, a.new_tokens, prefix, a.block_size))
    same = all(x["tokens"] == y["tokens"] for x, y in zip(runs[False], runs[True]))

    def summary(mode: list[dict[str, Any]]) -> dict[str, Any]:
        warm = [t for run in mode for t in run["ttft"][1:]]
        dec = sum(s for run in mode for s in run["decode_s"])
        return {"ttft_ms_median": round(statistics.median(warm) * 1e3, 2),
                "ttft_ms_first": round(statistics.median(run["ttft"][0] for run in mode) * 1e3, 2),
                "decode_tokens_per_s": round(len(mode) * len(prompts) * (a.new_tokens - 1) / dec, 2)}

    off, on = summary(runs[False]), summary(runs[True])
    stats = runs[True][-1]["prefix"]
    result = {
        "model": loaded.name, "requests": a.requests, "prompt_tokens": len(prompts[0]), "new_tokens": a.new_tokens,
        "rounds": a.rounds, "block_size": a.block_size, "without": off, "with": on,
        "ttft_ratio": round(on["ttft_ms_median"] / off["ttft_ms_median"], 3),
        "decode_ratio": round(on["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3),
        "prompt_tokens_from_cache": round(stats["token_hit_rate"], 3),
        # of the requests after the first (which finds the cache empty)
        "prompt_tokens_from_cache_warm": round(stats["hit_tokens"] / (stats["prompt_tokens"] - len(prompts[0])), 3),
        "greedy_tokens_identical": same,
        "threads": a.threads,
        "load": os.getloadavg()[0],
    }
    print(f"{result['model']}: {a.requests} requests of {len(prompts[0])} prompt tokens (shared system prompt), "
          f"{a.new_tokens} new tokens each, {a.rounds} round(s); load {result['load']:.2f}")
    print(f"  TTFT median   without {off['ttft_ms_median']:8.1f} ms   with {on['ttft_ms_median']:8.1f} ms   "
          f"ratio {result['ttft_ratio']:.3f}  (goal <= 0.3)")
    print(f"  decode tok/s  without {off['decode_tokens_per_s']:8.1f}      with {on['decode_tokens_per_s']:8.1f}      "
          f"ratio {result['decode_ratio']:.3f}")
    print(f"  prompt tokens served from the cache: {result['prompt_tokens_from_cache']:.1%} of all (goal >= 80%), "
          f"{result['prompt_tokens_from_cache_warm']:.1%} of the requests after the first")
    print(f"  greedy tokens identical: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
