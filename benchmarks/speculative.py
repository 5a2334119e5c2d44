"""Speculative decoding benchmark: tokens/s with prompt-lookup drafting against plain decoding, one run.

    .venv/bin/python benchmarks/speculative.py                 # SmolLM2-135M, batch 1 and 8, 1 thread
    .venv/bin/python benchmarks/speculative.py --tiny --quick  # a small random Llama, for a smoke test
    .venv/bin/python benchmarks/speculative.py --draft PATH    # a draft model instead of prompt lookup

Two workloads, greedy: *edit* (rewrite a given passage with one word changed: the output copies its
input, so the tokens that followed the last n-gram earlier in the sequence are usually right) and
*free* (open-ended questions: lookup rarely finds anything, and what it finds is rarely accepted). Each
is run at batch 1 (one request at a time) and batch 8 (eight at once, continuous batching), plain and
speculative alternating (ABAB, ``--repeats`` pairs) in one process; the figure is the median of the
per-pair ratios of generated tokens per second (wall clock). The greedy tokens must be identical.
Goals (issue 12): >= 1.5x at batch 1 on edit, no more than 5% slower on free.
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

from kvdoctor.engine.model.model import load_model, tiny_llama
from kvdoctor.engine.serving.runner import Runner, SamplingParams
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.engine.serving.speculative import ModelDrafter, NgramDrafter

PASSAGE = (
    "A paged KV cache stores the keys and values of every token in fixed-size blocks. When the device runs "
    "out of blocks, the scheduler preempts a request and swaps its blocks to host memory, and brings them "
    "back when the request runs again. Each block keeps a version, so a stale copy can be told from a fresh one."
)
EDIT = [f"Repeat the following text exactly, but write '{w}' instead of 'blocks':\n\n{PASSAGE}"
        for w in ("pages", "chunks", "slabs", "tiles", "cells", "frames", "parcels", "units")]
FREE = ["Write a short poem about the sea.", "What should I cook for dinner tonight?",
        "Describe your ideal holiday.", "Give me three tips for learning the piano.",
        "Why is the sky blue?", "Tell me about the history of tea.",
        "What makes a good friend?", "Invent a name for a new colour and describe it."]


def run(runner: Runner, prompts: list[list[int]], new_tokens: int, batch: int, drafter: Any, k: int
        ) -> tuple[float, list[list[int]], dict[str, Any]]:
    """Generated tokens per second over ``prompts`` at ``batch`` requests at a time, their tokens, and
    the speculation figures."""
    sched = Scheduler(runner, max_batch=batch, drafter=drafter, num_draft=k)
    seqs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs += [sched.submit(Request(p, max_new_tokens=new_tokens, ignore_eos=True, sampling=SamplingParams()))
                 for p in prompts[i:i + batch]]
        sched.run()
    elapsed = time.perf_counter() - t0
    tokens = [sched.done[s].token_ids for s in seqs]
    return sum(len(t) for t in tokens) / elapsed, tokens, sched.spec_stats()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests, one pair")
    ap.add_argument("--draft", metavar="PATH", help="a draft model checkpoint instead of prompt lookup")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=8, help="requests per workload (batch 1 runs 2 of them)")
    ap.add_argument("--repeats", type=int, default=2, help="plain/speculative pairs per case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    if a.quick:
        a.new_tokens, a.requests, a.repeats = 16, 4, 1
    torch.set_num_threads(a.threads)
    loaded = tiny_llama(vocab_size=512, max_position_embeddings=4096) if a.tiny else load_model(None)
    runner = Runner.create(loaded.model, tokenizer=loaded.tokenizer, block_size=16, device_blocks=512,
                           host_blocks=0, stats_every=0)
    if a.draft:
        d = load_model(a.draft)
        drafter: Any = ModelDrafter(Runner.create(d.model, block_size=16, device_blocks=512, host_blocks=0,
                                                  stats_every=0), loaded.model.config.vocab_size)
    else:
        drafter = NgramDrafter()
    if a.tiny:  # random weights: an "edit" prompt is one that repeats itself
        import random

        rng = random.Random(0)
        vocab = loaded.model.config.vocab_size
        edit = [[rng.randrange(3, vocab) for _ in range(12)] * 6 for _ in range(a.requests)]
        free = [[rng.randrange(3, vocab) for _ in range(72)] for _ in range(a.requests)]
    else:
        edit = [runner.encode(t, chat=True) for t in EDIT[:a.requests]]
        free = [runner.encode(t, chat=True) for t in FREE[:a.requests]]
    cases = []
    same = True
    for name, prompts in (("edit", edit), ("free", free)):
        for batch in (1, 8):
            work = prompts[:2] if batch == 1 else prompts
            ratios, rates, figures = [], {"plain": [], "speculative": []}, {}
            for _ in range(a.repeats):
                plain, plain_tokens, _ = run(runner, work, a.new_tokens, batch, None, a.num_draft)
                spec, spec_tokens, figures = run(runner, work, a.new_tokens, batch, drafter, a.num_draft)
                same &= plain_tokens == spec_tokens
                ratios.append(spec / plain)
                rates["plain"].append(plain)
                rates["speculative"].append(spec)
            case = {"workload": name, "batch": batch, "requests": len(work),
                    "plain_tok_s": round(statistics.median(rates["plain"]), 2),
                    "speculative_tok_s": round(statistics.median(rates["speculative"]), 2),
                    "ratio": round(statistics.median(ratios), 3),
                    "acceptance_rate": round(figures["acceptance_rate"], 3),
                    "tokens_per_forward": round(figures["tokens_per_forward"], 2)}
            cases.append(case)
            print(f"{name:5s} batch {batch}: plain {case['plain_tok_s']:7.2f} tok/s, speculative "
                  f"{case['speculative_tok_s']:7.2f} tok/s, ratio {case['ratio']:.3f}; acceptance "
                  f"{case['acceptance_rate']:.2f}, {case['tokens_per_forward']:.2f} tokens per forward", flush=True)
    runner.close()
    drafter.close()
    result = {"model": loaded.name, "drafter": a.draft or "ngram", "num_draft": a.num_draft,
              "new_tokens": a.new_tokens, "threads": a.threads, "cases": cases,
              "greedy_tokens_identical": same, "load": os.getloadavg()[0]}
    print(f"{loaded.name}, drafter {result['drafter']}, k={a.num_draft}, {a.new_tokens} new tokens, "
          f"load {result['load']:.2f}; greedy tokens identical: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
