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
layers (which verify a read's picks inside attention, over the bytes they read).

``--cost`` measures what the sweep costs a decode step instead, at batch 1 and 8 (listened: digests are kept only
then), by CPU time (on a shared machine, what other processes take is not counted): on the compiled layers, each
step that verifies runs its layers ``_REPEATS`` more pairs of times on a copy of its input, verifying and not, in
turn first; the median difference per block verified, times the blocks verified a step, is the verification
inside attention; plus what is verified by a pass over a block's bytes (the torch path, a mismatch looked at
again) and the sampler, timed around their calls; beside it, the commits' look for NaN/Inf in the K/V they
stored (``engine/kv/nonfinite.py``), timed the same way. A step's time leaves the extra runs out. On the torch path
(``--torch-layers``) each block verified is costed as a pass (``verify``, timed in a run of ``full``). Usage::

    .venv/bin/python benchmarks/corruption.py [--faults bit-flip noise] [--prompt-tokens 640] [--torch-layers]
    .venv/bin/python benchmarks/corruption.py --cost [--cost-tokens 128] [--prompt-tokens 640] [--torch-layers]
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
_REPEATS = 4  # --cost: pairs of the compiled layers' runs, verifying and not, on each step that verifies


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


def cost(lm: Any, batch: int, new_tokens: int, prompt_tokens: int | None) -> dict:
    """The sweep's cost per decode step at ``batch`` (see the module docstring)."""
    import statistics
    import time

    from pairing import prefilled
    from kvdoctor.engine import Runner
    from kvdoctor.engine.model.decode_layer import DecodeStep
    from kvdoctor.events import Read

    prompts = (prompts_of(lm.tokenizer, prompt_tokens) * 2)[:batch]
    blocks = sum(len(p) + new_tokens for p in prompts) // 16 + 2 * batch
    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, block_size=16, device_blocks=blocks + 16, host_blocks=0)
    book = runner.cache.digests
    picks: list[int] = []
    runner.bus.subscribe(lambda evs: picks.extend(sum(d is not None for d in e.digests or ()) for e in evs
                                                  if isinstance(e, Read)))
    inside = {"sample": 0.0, "verify": 0.0, "of": 0.0}  # "of": the commits' look for NaN/Inf K/V (nonfinite)
    owners = {"sample": book, "verify": book, "of": runner.cache.writes.nonfinite}
    originals = {name: getattr(owners[name], name) for name in inside}
    per_block: list[float] = []  # CPU seconds verifying one block inside the compiled layers' attention costs
    extra = [0.0]  # CPU seconds of the runs ``twice`` adds
    run_layers = DecodeStep.run

    def timed(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:  # this thread's CPU time: the team's threads spin meanwhile
            t0 = time.thread_time()
            try:
                return originals[name](*a, **k)
            finally:
                inside[name] += time.thread_time() - t0
        return call

    def twice(step: DecodeStep, x: Any, cos: Any, sin: Any, kv: Any, verify: Any = None) -> Any:
        """Before the step's layers run as asked, ``_REPEATS`` pairs of runs on copies of ``x`` (the same K/V
        stored to the same rows), one verifying as asked and one not, in turn first: each pair's difference per
        block verified is what verifying a block inside attention costs."""
        if not verify or not any(verify):
            return run_layers(step, x, cos, sin, kv, verify)
        n, t_start = sum(map(len, verify)), time.process_time()
        for i in range(_REPEATS):
            took = {}
            for verifying in ((True, False) if i % 2 == 0 else (False, True)):
                t0 = time.process_time()
                run_layers(step, x.clone(), cos, sin, kv, verify if verifying else None)
                took[verifying] = time.process_time() - t0
            per_block.append((took[True] - took[False]) / n)
        extra[0] += time.process_time() - t_start
        return run_layers(step, x, cos, sin, kv, verify)

    def decode(mode: str) -> tuple[float, float, dict[str, float]]:
        """(CPU seconds a step, blocks verified a step, seconds a step inside each timed part) of one run; a
        step's time leaves out the compiled layers' second call."""
        book.mode = mode
        sched = prefilled(runner, prompts, new_tokens)
        for _ in range(sum(map(len, prompts)) // sched.max_step_tokens):  # the prefills the first step left
            sched.step()
        picks.clear()
        for name in inside:
            inside[name] = 0.0
        per_block.clear()
        extra[0] = 0.0
        steps, t0 = 0, time.process_time()  # CPU time: on a shared machine, what others take is not counted
        while sched.live:
            sched.step()
            steps += 1
        spent = time.process_time() - t0 - extra[0]
        return spent / steps, sum(picks) / steps, {k: v / steps for k, v in inside.items()}

    for name in inside:
        setattr(owners[name], name, timed(name))
    DecodeStep.run = twice
    try:
        _, full_blocks, full_parts = decode("full")  # every block of every read by a pass: the cost of one
        step_s, per_step, parts = decode("sample")
    finally:
        DecodeStep.run = run_layers
        book.mode = "sample"
        for name, fn in originals.items():
            setattr(owners[name], name, fn)
        runner.close()
    block_us = 1e6 * full_parts["verify"] / full_blocks
    pairs = len(per_block)
    block_in_attention_us = 1e6 * statistics.median(per_block) if pairs else 0.0
    in_attention_us = per_step * block_in_attention_us
    # verified by a pass (the torch path, first reads, a mismatch looked at again) and the sampler, as timed
    passes_us = 1e6 * (parts["verify"] + parts["sample"])
    total_us = in_attention_us + passes_us if pairs else per_step * block_us + 1e6 * parts["sample"]
    return {"batch": batch, "blocks": -(-len(prompts[0]) // 16), "step_ms": round(1e3 * step_s, 2),
            "picks_per_step": round(per_step, 3), "block_us": round(block_us, 1),
            "sample_us": round(1e6 * parts["sample"], 1), "passes_us": round(passes_us, 1), "kernel_pairs": pairs,
            "block_in_attention_us": round(block_in_attention_us, 1),
            "in_attention_us": round(in_attention_us, 1), "sweep_us": round(total_us, 1),
            "share": round(total_us / (1e6 * step_s), 5), "nonfinite_us": round(1e6 * parts["of"], 1),
            "nonfinite_share": round(parts["of"] / step_s, 5)}


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
            r = cost(lm, batch, args.cost_tokens, args.prompt_tokens)
            how = (f"inside attention at {r['block_in_attention_us']} us a block (median of {r['kernel_pairs']} "
                   f"pairs) = {r['in_attention_us']} us, by passes and the sampler {r['passes_us']} us"
                   if r["kernel_pairs"] else
                   f"at {r['block_us']} us each by a pass, sampler {r['sample_us']} us")
            print(json.dumps(r) if args.json else
                  f"batch {batch} ({r['blocks']} blocks a row): {r['picks_per_step']} blocks verified a step, {how}: "
                  f"{r['sweep_us']} us of a {r['step_ms']} ms step ({100 * r['share']:.2f}%); the commits' look for "
                  f"NaN/Inf K/V {r['nonfinite_us']} us ({100 * r['nonfinite_share']:.3f}%)", flush=True)
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
