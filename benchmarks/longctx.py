"""Long context: SmolLM2-135M with a context 4x the device tier, streamed from host and disk, against fully resident.

Runners over the same model and text, side by side in one run:

- ``resident``: dense attention, every block on the device (the reference);
- ``resident-topkK``: block-sparse top-k at the first ``--topk`` value, every block on the device;
- ``streamed``: dense attention, a device tier of a quarter of the context, the rest on host and disk,
  read through the staging area and merged by log-sum-exp;
- ``streamed-topkK``: top-k over the same tiers, one runner per ``--topk`` value (the tradeoff curve): only the
  chosen pages are read, each layer's picks kept staged for the next step (their prediction), blocks read from
  a slower tier prefetched to the device in the background.

Top-k runs as Quest does: the prompt is prefilled densely (``dense_prefill``); ``--dense-layers N`` also keeps
the first N layers dense (Quest keeps two; on SmolLM2 that changed nothing measurable, so the default is 0).

Each runner prefills ``--context`` tokens of a text (chunked as the device allows), then decodes
``--eval`` steps fed with the text's next tokens (teacher forcing): that gives perplexity over those
tokens, each step's greedy choice, and the decode time per token. The runners take their steps in turn
(step i of each, then step i+1), so machine noise falls on all alike; a runner's time ratio is the median
of its per-step ratios to the resident step beside it, with their quartiles. Then ``--greedy`` free-running
greedy tokens from the dense runners must be identical. The CPU, torch's threads and the load average
(before and after) are printed with the figures.

Texts are ``benchmarks/quality.py``'s (the second half of pydoc's topics and the GPL-3).

Usage::

    .venv/bin/python benchmarks/longctx.py [--context 1024] [--eval 24] [--topk 8,16,32] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quality import texts  # noqa: E402  (the same texts as the quality benchmark)


def _runners(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvdoctor.engine.serving.runner import Runner

    bs = args.block_size
    blocks = -(-(args.context + args.eval + args.greedy + 1) // bs)
    device = -(-args.context // bs) // 4  # the context is 4x the device tier
    host = blocks // 4
    tiers = {"device_blocks": device, "host_blocks": host, "disk_blocks": blocks - host + 4,
             "staging_blocks": args.staging, "eviction": args.eviction}

    def sparse(k: int) -> dict[str, Any]:
        return {"topk": k, "sink_blocks": 1, "local_blocks": 1, "dense_prefill": True,
                "dense_layers": args.dense_layers}

    made = {
        "resident": {"device_blocks": blocks + 4, "host_blocks": 0},
        "streamed": tiers,
        f"resident-topk{args.topk[0]}": {"device_blocks": blocks + 4, "host_blocks": 0, **sparse(args.topk[0])},
        **{f"streamed-topk{k}": {**tiers, **sparse(k)} for k in args.topk},
    }
    return {name: Runner.create(model, stats_every=0, block_size=bs, **cfg) for name, cfg in made.items()}


def _prefill(runner: Any, seq: str, ids: list[int]) -> None:
    cache = runner.cache
    cache.add_sequence(seq, prompt_len=len(ids))
    while cache.seq_len(seq) < len(ids):
        done = cache.seq_len(seq)
        limit = cache.max_step_tokens(seq) or 512
        runner.forward([(seq, ids[done : done + min(limit, 512)])])
        cache.end_step()


@torch.inference_mode()
def run_text(model: Any, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    runners = _runners(model, args)
    ctx = args.context
    for r in runners.values():
        _prefill(r, "t", ids[:ctx])
    times: dict[str, list[float]] = {n: [] for n in runners}
    nll = {n: 0.0 for n in runners}
    picks: dict[str, list[int]] = {n: [] for n in runners}
    for i in range(args.eval):
        tok, target = ids[ctx + i], ids[ctx + i + 1]
        for name, r in runners.items():
            t0 = time.perf_counter()
            logits = r.forward([("t", [tok])])[0]
            times[name].append(time.perf_counter() - t0)
            r.cache.end_step()
            nll[name] -= float(torch.log_softmax(logits, -1)[target])
            picks[name].append(int(logits.argmax()))
    free: dict[str, list[int]] = {}
    for name in ("resident", "streamed"):  # free-running greedy from the same state
        r, out, tok = runners[name], [], ids[ctx + args.eval]
        for _ in range(args.greedy):
            tok = int(r.forward([("t", [tok])])[0].argmax())
            r.cache.end_step()
            out.append(tok)
        free[name] = out
    out: dict[str, Any] = {"settings": {}}
    for name, r in runners.items():
        c = r.cache
        reads = c.rows_from_device + c.rows_from_slower
        moved = c.bytes_staged + sum(c.stats()["swaps"].values()) * c.config.bytes_per_block
        steps = ctx + args.eval + (args.greedy if name in free else 0)
        out["settings"][name] = {
            "ppl": math.exp(nll[name] / args.eval),
            "decode_ms_median": statistics.median(times[name]) * 1e3,
            "device_blocks": c.config.device_blocks, "host_blocks": c.config.host_blocks,
            "disk_blocks": c.config.disk_blocks,
            "bytes_moved_per_token": moved / steps,
            "device_hit_rate": c.rows_from_device / reads if reads else None,
            "prefetch_hit_rate": c.stats()["prefetch_hit_rate"],
            "swaps": c.stats()["swaps"],
        }
        r.close()
    base = statistics.median(times["resident"])
    dense_ppl = out["settings"]["resident"]["ppl"]
    for name in runners:
        # per-step ratios to the resident step taken right before it: their median and quartiles
        ratios = [a / b for a, b in zip(times[name], times["resident"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        ms = [t * 1e3 for t in times[name]]
        m1, _, m3 = statistics.quantiles(ms, n=4) if len(ms) > 1 else (ms[0],) * 3
        out["settings"][name].update(time_ratio=statistics.median(ratios), time_ratio_q1=q1, time_ratio_q3=q3,
                                     decode_ms_q1=m1, decode_ms_q3=m3,
                                     median_ratio=statistics.median(times[name]) / base,
                                     ppl_change=out["settings"][name]["ppl"] / dense_ppl - 1)
    out["teacher_forced_picks_identical"] = picks["streamed"] == picks["resident"]
    out["greedy_identical"] = free["streamed"] == free["resident"]
    out["greedy_tokens"] = free["resident"]
    return out


def machine() -> dict[str, Any]:
    """The CPU, torch's threads and the load average: the context the figures were measured in."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               None) if os.path.exists("/proc/cpuinfo") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=1024, help="tokens of context (default 1024: 4x a 256-token device)")
    p.add_argument("--eval", type=int, default=24, help="teacher-forced decode steps measured (default 24)")
    p.add_argument("--greedy", type=int, default=16, help="free-running greedy tokens compared (default 16)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--staging", type=int, default=16, help="staging area in blocks (default 16)")
    p.add_argument("--topk", type=lambda s: [int(x) for x in s.split(",")], default=[16],
                   help="top-k pages (blocks), comma-separated: one streamed runner each, the first also resident "
                        "(default 16)")
    p.add_argument("--dense-layers", type=int, default=0, help="first layers read densely under top-k (default 0)")
    p.add_argument("--eviction", default="hybrid", help="placement policy of the streamed runs (default hybrid)")
    p.add_argument("--texts", default="pydoc,GPL-3", help="texts (default pydoc,GPL-3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvdoctor.engine.model.model import load_model

    loaded = load_model()
    data = {k: v for k, v in texts(loaded.tokenizer, args.context + args.eval + args.greedy).items()
            if k in args.texts.split(",")}
    results, before = {}, machine()
    for name, ids in data.items():
        results[name] = run_text(loaded.model, ids, args)
        print(f"# {name} done", file=sys.stderr, flush=True)
    env = {"before": before, "after": machine()}
    if args.json:
        print(json.dumps({"args": vars(args), "machine": env, "texts": results}, indent=1))
        return 0
    print(f"{before['cpu']}, {before['cores']} cores, torch threads {before['torch_threads']}, load average "
          f"{before['loadavg']} before, {env['after']['loadavg']} after")
    for name, res in results.items():
        print(f"\n{name}: context {args.context}, teacher-forced picks identical (streamed vs resident): "
              f"{res['teacher_forced_picks_identical']}, free greedy identical: {res['greedy_identical']}")
        print("| setting | tiers (dev/host/disk) | ppl | ppl vs dense | decode ms (median, q1-q3) | ratio to resident "
              "(median, q1-q3) | B moved/token | device hit rate | prefetch hit rate |")
        print("|---|---|---|---|---|---|---|---|---|")
        for s, r in res["settings"].items():
            hit = "-" if r["device_hit_rate"] is None else f"{r['device_hit_rate']:.2f}"
            pf = "-" if r["prefetch_hit_rate"] is None else f"{r['prefetch_hit_rate']:.2f}"
            print(f"| {s} | {r['device_blocks']}/{r['host_blocks']}/{r['disk_blocks']} | {r['ppl']:.3f} | "
                  f"{r['ppl_change']:+.1%} | {r['decode_ms_median']:.0f} ({r['decode_ms_q1']:.0f}-{r['decode_ms_q3']:.0f}) | "
                  f"{r['time_ratio']:.2f}x ({r['time_ratio_q1']:.2f}-{r['time_ratio_q3']:.2f}) | "
                  f"{r['bytes_moved_per_token']:.0f} | {hit} | {pf} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
