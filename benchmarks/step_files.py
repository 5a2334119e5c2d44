"""Which engine source files one decode step runs, and how often its calls cross from one file into another.

A structural measurement, not a timing: the step is traced with ``sys.setprofile`` and every Python call whose
code lies in the engine's folder is booked by file. It counts what a reader following a decode step must open:
the distinct files, and the crossings (a call whose callee's file is not its caller's); for the whole step, and
for its read of K/V alone (everything under the functions ``READS`` names: the block tables and row offsets a
step reads by, its read plan's since there is one, each layer's gather, attention, the cache's read methods).
The step is a batch of four rows on a small random Llama with every feature off (``--features``: top-k, merging
and hybrid eviction on), after two warm steps, on the torch path (the compiled decode layers run in C and would
hide the Python path; ``--compiled``: the default path). It imports only the engine's public names
(``kvdoctor.engine``), so it runs unchanged on an older commit's checkout. Usage::

    .venv/bin/python benchmarks/step_files.py [--features] [--compiled] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any


# How the runner reads K/V, by the names of every commit measured: its groups of rows with their block tables
# (``slot_table`` and ``read_rows`` before the read plan; the plan's ``read_plan`` and ``table`` after), token
# merging's score bias (``key_bias``), each layer's K/V gathered (``_gather_kv``, the plan's ``gather``), attention
# over them (dense, sparse, windowed, merged), the block ids a read names (``block_table``, the plan's
# ``block_ids``), and the cache's reads. Residency (bringing blocks to the device) is the mover's, not the read's.
READS = {"_groups", "_gather_kv", "_attend_groups", "read_blocks", "read_rows", "layer_kv", "block_table", "slot_table",
         "read_plan", "table", "gather", "key_bias", "block_ids", "attend"}
# The features a step can run with, each changing what attention reads: top-k block-sparse reads, token
# merging, hybrid eviction with attention importance.
FEATURES = {"topk": 2, "merge": 0.9, "eviction": "hybrid"}


def _tiny_model() -> Any:
    import kvdoctor.engine as engine

    home = Path(engine.__file__).parent
    for name in ("kvdoctor.engine.model.model", "kvdoctor.engine.model"):  # the folder layout, or the flat one
        try:
            module = __import__(name, fromlist=["tiny_llama"])
            if hasattr(module, "tiny_llama"):
                return module.tiny_llama(num_layers=2).model, home
        except ImportError:
            continue
    raise SystemExit("no tiny_llama in this checkout")


def trace_step(compiled: bool, features: bool = False) -> dict[str, Any]:
    os.environ["KVDOCTOR_DECODE_LAYER"] = "1" if compiled else "0"
    from kvdoctor.engine import Request, Runner, Scheduler

    model, home = _tiny_model()
    runner = Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, **(FEATURES if features else {}))
    sched = Scheduler(runner, max_batch=4)
    for n in (13, 17, 21, 25):  # past the sinks and the window, so top-k has blocks to choose from
        sched.submit(Request(list(range(1, n + 1)), max_new_tokens=8, ignore_eos=True))
    for _ in range(3):  # prefill and two decode steps: caches, plans and kernels are warm
        sched.step()
    step, read = _Tally(), _Tally()
    stack: list[tuple[str | None, bool]] = []  # per frame: the engine file it runs in (or its caller's), in a read

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            mine = "engine/" + os.path.relpath(path, home) if path.startswith(str(home)) else None
            caller, reading = stack[-1] if stack else (None, False)
            if mine is not None:
                reading = reading or frame.f_code.co_name in READS
                step.book(mine, caller)
                if reading:
                    read.book(mine, caller)
            stack.append((mine if mine is not None else caller, reading))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        sched.step()
    finally:
        sys.setprofile(None)
    runner.close()
    return {"step": step.summary(), "read": read.summary()}


class _Tally:
    def __init__(self) -> None:
        self.files: collections.Counter[str] = collections.Counter()
        self.crossings = 0

    def book(self, file: str, caller: str | None) -> None:
        self.files[file] += 1
        self.crossings += caller is not None and caller != file

    def summary(self) -> dict[str, Any]:
        return {"files": len(self.files), "crossings": self.crossings, "calls": sum(self.files.values()),
                "by_file": dict(self.files.most_common())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compiled", action="store_true", help="the default path (compiled decode layers where they apply)")
    ap.add_argument("--features", action="store_true", help=f"the step with {FEATURES}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = trace_step(args.compiled, args.features)
    if args.json:
        print(json.dumps(out))
    else:
        for part, s in out.items():
            print(f"{part}: {s['files']} engine files, {s['crossings']} crossings, {s['calls']} calls")
            for f, n in s["by_file"].items():
                print(f"  {n:6d}  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
