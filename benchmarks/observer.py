"""What ``kvdoctor.observe`` costs on transformers' ``generate``: observed against plain, same process.

The embedded SmolLM2-135M-Instruct (or ``--tiny``: a small random Llama), greedy decoding of
``--new-tokens`` tokens per row with end-of-sequence ignored, at batch 1 (one prompt) and batch 8
(eight prompts of different lengths, left-padded). The observed side writes every event, with
attention statistics at every layer and step, to a trace file. The two sides run in interleaved
ABBA pairs (plain, observed, observed, plain, …), each pair giving the ratio of the observed run's
time to the plain run's; the median of the ratios with its quartiles is reported, by CPU time
(fairer on a shared machine with ``--threads 1``) and by wall clock.

On a loaded machine those ratios scatter by several percent either way, more than the observer
costs. So ``--self-time`` also runs ``--pairs`` observed calls with the observer's own code timed
(thread CPU time inside its forward hooks and its per-layer attention tap; not the few Python calls
that pass through its wrappers) and reports that time as a share of the same calls' total: a lower
bound of the overhead that load does not blur. Usage::

    .venv/bin/python benchmarks/observer.py [--threads 1] [--new-tokens 32] [--pairs 5] [--tiny] [--self-time] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import kvdoctor
from kvdoctor.engine.model.model import load_model, tiny_llama
from kvdoctor.integrations.transformers import Observer
from kvdoctor.integrations.transformers_attention import AttentionTap

_TIMED = ((Observer, ("_before", "_after")), (AttentionTap, ("_observe",)))  # the observer's per-pass and per-layer work

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
    "Explain in one sentence why the sky is blue, for a child who asks about it at bedtime.",
    "Hello", "Translate 'good morning' into Spanish, French and German.", "2 + 2 =",
    "Summarise the plot of a detective story in which the butler did not do it.",
]


def _inputs(tok, batch: int, vocab: int) -> dict:
    if tok is None:
        gen = torch.Generator().manual_seed(batch)
        lengths = [5 + 3 * i for i in range(batch)]
        ids = torch.zeros(batch, max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, -n:] = torch.randint(3, vocab, (n,), generator=gen)
            mask[i, -n:] = 1
        return {"input_ids": ids, "attention_mask": mask}
    tok.padding_side = "left"
    return dict(tok(PROMPTS[:batch], return_tensors="pt", padding=True))


def _timed(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def _quartiles(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": round(q[1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4)}


class _SelfTime:
    """Thread CPU time spent inside the observer's hooks while installed (class attributes, put back on exit)."""

    def __init__(self) -> None:
        self.ns = 0
        self._saved: list[tuple[type, str, object]] = []

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - t0
        return timed

    def __enter__(self) -> "_SelfTime":
        for cls, names in _TIMED:
            for name in names:
                self._saved.append((cls, name, vars(cls)[name]))
                setattr(cls, name, self._timed(vars(cls)[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


def bench(model, tok, batch: int, new_tokens: int, pairs: int, directory: str, self_time: bool = False) -> dict:
    inputs = _inputs(tok, batch, model.config.vocab_size)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0)

    def plain() -> None:
        model.generate(**inputs, **kwargs)

    def observed() -> None:
        with kvdoctor.observe(model, trace=os.path.join(directory, f"b{batch}.kvtrace")):
            model.generate(**inputs, **kwargs)

    plain(), observed()  # warm both paths
    cpu, wall = [], []
    for i in range(pairs):
        order = (plain, observed) if i % 2 == 0 else (observed, plain)
        times = {fn: _timed(fn) for fn in order}
        cpu.append(times[observed][0] / times[plain][0])
        wall.append(times[observed][1] / times[plain][1])
    result = {"batch": batch, "new_tokens": new_tokens, "pairs": pairs,
              "cpu_ratio": _quartiles(cpu), "wall_ratio": _quartiles(wall)}
    if self_time:
        shares = []
        for _ in range(pairs):
            with _SelfTime() as timer:
                t0 = time.thread_time_ns()
                observed()
                total = time.thread_time_ns() - t0
            shares.append(timer.ns / (total - timer.ns))  # the observer's time over the rest of the call
        result["self_share"] = _quartiles(shares)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2")
    p.add_argument("--self-time", action="store_true", help="also time the observer's own code inside observed calls")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = tiny_llama(num_layers=4, hidden_size=128) if args.tiny else load_model()
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for batch in args.batches:
            results.append(bench(loaded.model, loaded.tokenizer, batch, args.new_tokens, args.pairs, directory,
                                 args.self_time))
    report = {"model": loaded.name, "threads": args.threads, "load": os.getloadavg(), "results": results}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(f"{loaded.name}, {args.threads} thread(s), load average {report['load'][0]:.1f}")
        for r in results:
            c, w = r["cpu_ratio"], r["wall_ratio"]
            print(f"batch {r['batch']}: observed/plain CPU {c['median']:.3f} [{c['q1']:.3f}, {c['q3']:.3f}]  "
                  f"wall {w['median']:.3f} [{w['q1']:.3f}, {w['q3']:.3f}]  ({r['pairs']} ABBA pairs, "
                  f"{r['new_tokens']} tokens)")
            if "self_share" in r:
                q = r["self_share"]
                print(f"         observer's own code / the rest of the call {q['median']:.4f} [{q['q1']:.4f}, {q['q3']:.4f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
