"""How soon the default verification finds K/V bytes that changed under the cache: the step of the first
integrity finding after each content fault fires.

Four SmolLM2 requests decode 36 tokens each in one continuous batch, listened to by every check, with the
default verification (``sample``: one read in every 16 of each sequence's verifies the block of that read
verified longest ago) unless ``--verify``. Each content fault (``engine/faults.py``: a foreign block copied
over a sequence's first block, a flipped bit, a token written a row off) fires once at step 2; the report is
the step it fired, the block, and the step of the first integrity finding (None: not found in the run).
Usage::

    .venv/bin/python benchmarks/corruption.py [--faults overwrite-foreign bit-flip row-off-by-one] [--verify full]
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = ["Tell me about the history of computing.", "What is a cache and why does it matter?",
           "Write a short poem about the sea.", "Explain paged attention in simple words."]


def first_found(lm, fault: str, verify: str | None, new_tokens: int) -> dict:
    from kvdoctor.checks import make_suite
    from kvdoctor.engine import Request, Runner, Scheduler

    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, block_size=16, device_blocks=64, host_blocks=16,
                           fault=fault, verify=verify)
    suite = make_suite()
    runner.bus.subscribe(suite.observe_many)
    sched = Scheduler(runner, max_batch=len(PROMPTS))
    for p in PROMPTS:
        sched.submit(Request(lm.tokenizer.encode(p), max_new_tokens=new_tokens + 1, ignore_eos=True))
    sched.run()
    runner.bus.flush()
    hit = runner.cache.faults.hit or {}
    runner.close()
    suite.finish()
    steps = [f.step for f in suite.findings if f.check == "integrity"]
    return {"fault": fault, "fired_step": hit.get("step"), "block": hit.get("block"),
            "found_step": min(steps, default=None), "integrity_findings": len(steps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", nargs="+", default=["overwrite-foreign", "bit-flip", "row-off-by-one"])
    ap.add_argument("--verify", choices=["sample", "full"], default=None, help="default: the engine's (sample)")
    ap.add_argument("--new-tokens", type=int, default=36)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from kvdoctor.engine.model.model import load_model

    lm = load_model(None)
    for fault in args.faults:
        r = first_found(lm, fault, args.verify, args.new_tokens)
        print(json.dumps(r) if args.json else
              f"{fault}: fired at step {r['fired_step']} (block {r['block']}), first found at step {r['found_step']}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
