"""How soon the default verification finds K/V bytes that changed under the cache: the steps from each content
fault to the first integrity finding, and the longest any block a sequence read went unverified.

Four SmolLM2 requests decode 36 tokens each in one continuous batch, listened to by every check, with the
default verification (``sample``: the bounded sweep of ``engine/kv/digest.py``, every block a sequence reads
verified at least once in every ``verify_every`` (N = 32) of its reads) unless ``--verify``. Each content fault
(``engine/faults.py``: a foreign block copied over a sequence's first block, a flipped bit, a token written a
row off, a zeroed block, small noise on its keys) fires once at step 2; the report is the step it fired, the
block, the steps until the first integrity finding (None: not found in the run), and, over the clean run, the
most steps any block went unverified while its sequence read it. ``--prompt-tokens 640`` makes every prompt
40 blocks long (more blocks than N); ``--torch-layers`` decodes by the torch path instead of the compiled
layers (which verify one block a row inside attention).

``--cost`` measures what the sweep costs a decode step instead, at batch 1 and 8 (listened: digests are kept only then):
the blocks it verifies a step, each costed as a pass over the block's bytes (``verify``, timed in place in a
run of ``full`` verification; the compiled layers' verification inside attention reads bytes attention has
just read, so this bounds it from above), plus the sampler's own time. Usage::

    .venv/bin/python benchmarks/corruption.py [--faults bit-flip noise] [--prompt-tokens 640] [--torch-layers]
    .venv/bin/python benchmarks/corruption.py --cost [--cost-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

PROMPTS = ["Tell me about the history of computing.", "What is a cache and why does it matter?",
           "Write a short poem about the sea.", "Explain paged attention in simple words."]
FAULTS = ["overwrite-foreign", "bit-flip", "row-off-by-one", "zeroed-block", "noise"]


class Gaps:
    """The most reads of a sequence, and the most steps, between two verifications of a block it reads: from the
    read events' digests (the first read's verification counts; a block's turn ends at its sequence's last read)."""

    def __init__(self) -> None:
        self.reads: dict[Any, int] = {}  # seq -> reads so far
        self.last: dict[tuple[Any, int], tuple[int, int]] = {}  # (seq, block) -> (read, step) last verified
        self.seen: dict[tuple[Any, int], tuple[int, int]] = {}  # (seq, block) -> (read, step) last read
        self.worst = (0, 0)

    def observe(self, events: list[Any]) -> None:
        from kvdoctor.events import Read

        for ev in events:
            if not isinstance(ev, Read):
                continue
            n = self.reads[ev.seq] = self.reads.get(ev.seq, 0) + 1
            for block, d in zip(ev.blocks, ev.digests or [None] * len(ev.blocks)):
                key = (ev.seq, block)
                self.seen[key] = (n, ev.step)
                if d is not None:
                    was = self.last.get(key, (n, ev.step))
                    self.worst = (max(self.worst[0], n - was[0]), max(self.worst[1], ev.step - was[1]))
                    self.last[key] = (n, ev.step)

    def finish(self) -> tuple[int, int]:
        """(reads, steps): the longest a read block went unverified."""
        tails = [(self.seen[k][0] - v[0], self.seen[k][1] - v[1]) for k, v in self.last.items()]
        return max(r for r, _ in [self.worst, *tails]), max(s for _, s in [self.worst, *tails])


def prompts_of(tokenizer: Any, length: int | None) -> list[list[int]]:
    """The four prompts, each repeated to ``length`` tokens when given."""
    out = []
    for p in PROMPTS:
        ids = tokenizer.encode(p)
        out.append(ids if length is None else (ids * (length // len(ids) + 1))[:length])
    return out


def run(lm: Any, fault: str | None, verify: str | None, new_tokens: int, prompts: list[list[int]]) -> dict:
    from kvdoctor.checks import make_suite
    from kvdoctor.engine import Request, Runner, Scheduler

    blocks = sum(len(p) + new_tokens for p in prompts) // 16 + 2 * len(prompts)
    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, block_size=16, device_blocks=blocks + 16, host_blocks=16,
                           fault=fault, verify=verify)
    suite, gaps = make_suite(), Gaps()
    runner.bus.subscribe(suite.observe_many)
    runner.bus.subscribe(gaps.observe)
    sched = Scheduler(runner, max_batch=len(prompts))
    for ids in prompts:
        sched.submit(Request(ids, max_new_tokens=new_tokens + 1, ignore_eos=True))
    sched.run()
    runner.bus.flush()
    hit = runner.cache.faults.hit or {}
    runner.close()
    suite.finish()
    steps = [f.step for f in suite.findings if f.check == "integrity"]
    found = min(steps, default=None)
    fired = hit.get("step")
    return {"fault": fault, "fired_step": fired, "block": hit.get("block"), "found_step": found,
            "steps_to_find": None if found is None or fired is None else found - fired,
            "integrity_findings": len(steps), "other_findings": len(suite.findings) - len(steps),
            "max_unverified": dict(zip(("reads", "steps"), gaps.finish()))}


def cost(lm: Any, batch: int, new_tokens: int) -> dict:
    """The sweep's cost per decode step at ``batch`` (see the module docstring)."""
    import time

    from pairing import prefilled
    from kvdoctor.engine import Runner
    from kvdoctor.events import Read

    prompts = (prompts_of(lm.tokenizer, None) * 2)[:batch]
    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, block_size=16, device_blocks=256, host_blocks=0)
    book = runner.cache.digests
    picks: list[int] = []
    runner.bus.subscribe(lambda evs: picks.extend(sum(d is not None for d in e.digests or ()) for e in evs
                                                  if isinstance(e, Read)))
    inside = {"sample": 0.0, "verify": 0.0}
    originals = {name: getattr(book, name) for name in inside}

    def timed(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return originals[name](*a, **k)
            finally:
                inside[name] += time.perf_counter() - t0
        return call

    def decode(mode: str) -> tuple[float, float, dict[str, float]]:
        """(seconds a step, blocks verified a step, seconds a step inside each timed part) of one run."""
        book.mode = mode
        sched = prefilled(runner, prompts, new_tokens)
        picks.clear()
        for name in inside:
            inside[name] = 0.0
        steps, t0 = 0, time.perf_counter()
        while sched.live:
            sched.step()
            steps += 1
        return (time.perf_counter() - t0) / steps, sum(picks) / steps, {k: v / steps for k, v in inside.items()}

    for name in inside:
        setattr(book, name, timed(name))
    try:
        step_s, per_step, parts = decode("sample")
        _, full_blocks, full_parts = decode("full")  # every block of every read by a pass: the cost of one
    finally:
        book.mode = "sample"
        for name, fn in originals.items():
            setattr(book, name, fn)
        runner.close()
    block_us = 1e6 * full_parts["verify"] / full_blocks
    total_us = per_step * block_us + 1e6 * parts["sample"]
    return {"batch": batch, "step_ms": round(1e3 * step_s, 2), "picks_per_step": round(per_step, 3),
            "block_us": round(block_us, 1), "sample_us": round(1e6 * parts["sample"], 1),
            "sweep_us": round(total_us, 1), "share": round(total_us / (1e6 * step_s), 5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", nargs="+", default=FAULTS)
    ap.add_argument("--verify", choices=["sample", "full"], default=None, help="default: the engine's (sample)")
    ap.add_argument("--new-tokens", type=int, default=36)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="each prompt repeated to this many tokens")
    ap.add_argument("--torch-layers", action="store_true", help="decode by the torch path (KVDOCTOR_DECODE_LAYER=0)")
    ap.add_argument("--cost", action="store_true", help="the sweep's cost per decode step at batch 1 and 8 instead")
    ap.add_argument("--cost-tokens", type=int, default=128, help="decode tokens per request in each cost run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.torch_layers:
        os.environ["KVDOCTOR_DECODE_LAYER"] = "0"  # read when the runner is made
    from kvdoctor.engine.model.model import load_model

    lm = load_model(None)
    if args.cost:
        for batch in (1, 8):
            r = cost(lm, batch, args.cost_tokens)
            print(json.dumps(r) if args.json else
                  f"batch {batch}: {r['picks_per_step']} blocks verified a step at {r['block_us']} us each, sampler "
                  f"{r['sample_us']} us: {r['sweep_us']} us of a {r['step_ms']} ms step ({100 * r['share']:.2f}%)",
                  flush=True)
        return 0
    prompts = prompts_of(lm.tokenizer, args.prompt_tokens)
    for fault in [None, *args.faults]:
        r = run(lm, fault, args.verify, args.new_tokens, prompts)
        if args.json:
            print(json.dumps(r), flush=True)
        elif fault is None:
            print(f"clean: {r['integrity_findings'] + r['other_findings']} findings; a read block went at most "
                  f"{r['max_unverified']['reads']} of its sequence's reads ({r['max_unverified']['steps']} steps) "
                  "unverified", flush=True)
        else:
            print(f"{fault}: fired at step {r['fired_step']} (block {r['block']}), found at step {r['found_step']} "
                  f"({r['steps_to_find']} steps after)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
