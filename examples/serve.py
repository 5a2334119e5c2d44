"""A stream of requests through a small device tier, recorded as a kvdoctor trace.

Requests arrive at random steps with random prompt and output lengths and
priorities; the scheduler batches them continuously, and because the device tier
is small it preempts lower-priority sequences by swapping them to host (and, when
host fills, to disk) and brings them back later. Open the trace afterwards with
``kvdoctor info``, ``kvdoctor check`` or ``kvdoctor replay``, or watch it live::

    .venv/bin/python examples/serve.py --trace serve.kvtrace
    kvdoctor watch -- .venv/bin/python examples/serve.py      # KVDOCTOR_TRACE set by watch
    .venv/bin/python examples/serve.py --fault leak-swapped --trace leak.kvtrace && kvdoctor check leak.kvtrace

``--tiny`` uses a small random Llama (no SmolLM2 load, token ids only) for a fast demo.
``--shared-prefix`` switches the engine's prefix cache on and opens every request with the same
chat system prompt (the demo's), so later requests are served those blocks from the cache::

    .venv/bin/python examples/serve.py --shared-prefix --trace prefix.kvtrace && kvdoctor check prefix.kvtrace
"""

from __future__ import annotations

import argparse
import random
import sys
import time

PROMPTS = [
    "Explain how a CPU cache works.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paper clip.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of a detective story in two sentences.",
    "Describe the water cycle for a ten-year-old.",
    "Why do we need sleep?",
    "Give me a recipe for a simple tomato soup.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Serve a random stream of requests through kvdoctor's engine.")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-gap", type=float, default=3.0, help="mean steps between arrivals")
    ap.add_argument("--min-new", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=16)
    ap.add_argument("--host-blocks", type=int, default=16)
    ap.add_argument("--disk-blocks", type=int, default=256)
    ap.add_argument("--model", help="a local checkpoint directory (default: the embedded SmolLM2)")
    ap.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2 (fast)")
    ap.add_argument("--trace", help="trace file (default: $KVDOCTOR_TRACE if set, else serve.kvtrace)")
    ap.add_argument("--fault", help="one of the engine's deliberate faults")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="prefix cache on, and every request opens with one chat system prompt")
    ap.add_argument("--cancel-rate", type=float, default=0.05,
                    help="chance per step that a client waiting on a swapped-out request gives up (default 0.05)")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (to watch live)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvdoctor import knobs
    from kvdoctor.demo import SYSTEM_PROMPT
    from kvdoctor.engine.model.model import load_model, tiny_llama
    from kvdoctor.engine.serving.runner import Runner, SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler
    from kvdoctor.trace import TraceWriter

    rng = random.Random(args.seed)
    loaded = tiny_llama(vocab_size=512, max_position_embeddings=4096) if args.tiny else load_model(args.model)
    runner = Runner.create(
        loaded.model, tokenizer=loaded.tokenizer, block_size=args.block_size, device_blocks=args.device_blocks,
        host_blocks=args.host_blocks, disk_blocks=args.disk_blocks, fault=args.fault, extra={"model": loaded.name},
        prefix_cache=args.shared_prefix,
    )
    # With KVDOCTOR_TRACE set (kvdoctor watch), the engine already writes that trace itself.
    writer = None
    if not knobs.get(knobs.TRACE) or args.trace:
        path = args.trace or "serve.kvtrace"
        writer = TraceWriter(path, runner.cache.header())
        runner.bus.subscribe(writer.write_many)
        print(f"writing {path}", file=sys.stderr)

    # The workload: arrival step, prompt, output length, priority; all drawn up front from the seed.
    arrivals = []
    step = 0
    system = [rng.randrange(3, loaded.config.vocab_size) for _ in range(4 * args.block_size)]  # --tiny --shared-prefix
    for i in range(args.requests):
        step += int(rng.expovariate(1 / args.mean_gap)) if i else 0
        if loaded.tokenizer is not None:
            ids = runner.encode(rng.choice(PROMPTS), chat=True, system=SYSTEM_PROMPT if args.shared_prefix else None)
        else:
            ids = (system if args.shared_prefix else []) + [
                rng.randrange(3, loaded.config.vocab_size) for _ in range(rng.randint(4, 60))]
        sampling = SamplingParams(greedy=False, temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
        arrivals.append((step, Request(ids, max_new_tokens=rng.randint(args.min_new, args.max_new),
                                       sampling=sampling, priority=rng.choice([0, 0, 1, 2]))))

    sched = Scheduler(runner, max_batch=args.max_batch)
    pending = list(arrivals)
    preempted = steps = 0
    t0 = time.perf_counter()
    while pending or sched.has_work():
        while pending and pending[0][0] <= steps:
            sched.submit(pending.pop(0)[1])
        # Clients give up while their request waits swapped out, as they do on a loaded server.
        for seq in [s for s in list(sched.live) if sched.state(s) == "swapped"]:
            if rng.random() < args.cancel_rate:
                sched.abort(seq)
                print(f"[step {steps:4d}] seq {seq} cancelled by its client while swapped out")
        result = sched.step()
        preempted += len(result.preempted)
        for gen in result.finished:
            text = gen.text if gen.text is not None else gen.token_ids
            print(f"[step {result.step:4d}] seq {gen.seq} {gen.finish_reason}: {len(gen.token_ids)} tokens  {text!r:.70}")
        steps += 1
        if args.step_delay:
            time.sleep(args.step_delay)
    elapsed = time.perf_counter() - t0
    stats = runner.cache.stats()
    runner.close()
    if writer is not None:
        writer.close()
    tokens = sum(len(g.token_ids) for g in sched.done.values())
    print(f"{len(sched.done)} requests, {tokens} tokens in {steps} steps, {elapsed:.1f} s; "
          f"{preempted} preemptions; moves {stats['swaps']}", file=sys.stderr)
    if "prefix" in stats:
        p = stats["prefix"]
        print(f"prefix cache: {p['hit_tokens']} of {p['prompt_tokens']} prompt tokens served from it "
              f"({p['token_hit_rate']:.0%}); {p['hit_blocks']} block hits, {p['miss_blocks']} misses", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
