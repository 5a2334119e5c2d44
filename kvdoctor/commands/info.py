"""``kvdoctor info FILE…``: what a trace holds, at a glance, without running any check; each trace of a
workload (several files, a directory, a glob) in turn, with who wrote it."""

from __future__ import annotations

import argparse
import json
from collections import Counter

NAME = "info"
HELP = "summarize a trace: header, event counts by kind, steps, duration, sequences, truncation"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="FILE", nargs="+",
                   help="a .kvtrace (or .kvtrace.gz) file; several, a directory or a glob: each trace of the workload")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of text (a list of them for several traces)")


# What a header says about who wrote the trace (docs/trace-format.md, "A workload is all of its traces").
_WHO = ("instance", "role", "dp_rank", "dp_size", "tp_rank", "tp_size", "pp_rank", "pp_size", "layers",
        "kernel_block_size", "kv_layout", "t0")


def summarize(path: str) -> dict:
    from pathlib import Path

    from ..events import Unknown
    from ..session import _writer_alive
    from ..trace import TraceReader, input_path

    reader = TraceReader(path)
    pid = reader.header.pid
    # a writer still at work: a cut last line is the step it is writing, not a kill
    writing = pid is not None and _writer_alive(input_path(path), pid)
    kinds: Counter[str] = Counter()
    seqs: set = set()
    first_step = last_step = None
    last_t = 0
    for batch in reader.batches():
        for ev in batch:
            kind = ev.kind if type(ev) is Unknown else ev.__struct_config__.tag
            kinds[kind] += 1
            if kind == "seq_start":
                seqs.add(ev.seq)
        if batch:
            first_step = batch[0].step if first_step is None else first_step
            last_step, last_t = batch[-1].step, max(last_t, batch[-1].t)
    h = reader.header
    return {
        "path": path,
        "format": h.format,
        "version": h.version,
        "model": h.model,
        "engine": h.engine,
        "created": h.created,
        "pid": h.pid,
        "calibration": h.calibration,
        "producer": {k: getattr(h, k) for k in _WHO if getattr(h, k) is not None},
        "block_size": h.block_size,
        "num_layers": h.num_layers,
        "tiers": {t.name: t.capacity_blocks for t in h.tiers},
        "codecs": {t.name: t.codec for t in h.tiers if t.codec is not None},
        "num_events": reader.num_events,
        "kinds": dict(kinds.most_common()),
        "steps": [first_step, last_step] if first_step is not None else None,
        "duration_s": last_t / 1e9,
        "num_sequences": len(seqs),
        "truncated": reader.truncated and not writing,
        "closed": reader.closed,
        "writing": writing and not reader.closed,
    }


def run(args: argparse.Namespace) -> int:
    from ..workload import trace_files

    infos = [summarize(path) for path in trace_files(args.trace)]
    if args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos))
        return 0
    for i, info in enumerate(infos):
        if i:
            print()
        _print(info)
    return 0


def _print(info: dict) -> None:
    tiers = ", ".join(f"{k} {v} blocks" + (f" ({info['codecs'][k]})" if k in info["codecs"] else "")
                      for k, v in info["tiers"].items())
    steps = "none" if info["steps"] is None else f"{info['steps'][0]}..{info['steps'][1]}"
    ending = (
        f"still being written (pid {info['pid']}); the events so far are counted" if info["writing"]
        else "truncated (the writer was killed mid-line; events before the cut are used)" if info["truncated"]
        else "closed by the writer" if info["closed"] else "not closed (the writer was killed between steps)")
    print(f"trace      {info['path']}")
    print(f"format     {info['format']} {info['version']}")
    for key in ("model", "engine", "created", "pid", "calibration"):
        if info[key] is not None:
            print(f"{key:<10} {info[key]}")
    if info["producer"]:
        print("producer   " + ", ".join(f"{k} {v}" for k, v in info["producer"].items()))
    print(f"cache      block size {info['block_size']}, {info['num_layers']} layers; {tiers}")
    print(f"events     {info['num_events']}")
    for kind, n in info["kinds"].items():
        print(f"  {kind:<16} {n}")
    print(f"steps      {steps}")
    print(f"duration   {info['duration_s']:.3f} s")
    print(f"sequences  {info['num_sequences']}")
    print(f"ending     {ending}")
