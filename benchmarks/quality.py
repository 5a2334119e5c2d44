"""What KV compression costs in quality: perplexity of SmolLM2-135M through kvdoctor's engine, per setting.

Every setting runs the same model through the engine's runner (``Runner.forward``
with every token's logits): the text goes in as chunked prefill of ``--chunk``
tokens, so every token is predicted from the whole context before it as the
engine holds it, stored under the codec, read block-sparse, or evicted. Perplexity
is over every predicted token of the context (``--context`` tokens, >= 4096).

Texts need no download: the second half of Python's ``pydoc_data.topics`` (the
calibration for INT8/NF4 uses only the first half) and the GNU GPL-3 text shipped
in ``/usr/share/common-licenses``.

Columns:
- ``ppl`` per text, and the change against dense FP32 (mean over texts);
- ``KV B/token``: bytes the cache holds per token of context once the text is in
  (the arena's blocks, padding and scales included), and that against FP16;
- ``KV B/step``: bytes of K/V one decode step reads at the end of the context
  (measured over ``--decode`` decode steps fed with the text's next tokens), and
  that as a share of what dense attention reads;
- ``live``: token merging's live (layer, head, slot) rows as a share of the rows the
  context's tokens fill (100% for every other setting): the bytes a store that
  kept only live slots would hold. The arena itself keeps whole blocks.

Usage::

    .venv/bin/python benchmarks/quality.py [--context 4096] [--chunk 512] [--block-size 64] [--only int8,topk8] [--json]

Settings: fp32 (the baseline), fp16, bf16, int8, nf4, mixed (when the engine has
it), ``topkK`` for each ``--topk`` (pages = cache blocks of ``--block-size``),
``topkK-p64`` for each ``--topk-pages`` (64-token pages over 16-token cache
blocks), streaming and h2o eviction, ``mergeT`` token merging at each ``--merge`` threshold T.
``--similarity`` also prints how alike adjacent keys are (post-RoPE cosine, per layer and
KV head, as merging measures it) on each text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

LICENSE = "/usr/share/common-licenses/GPL-3"


@dataclass
class Setting:
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def settings(calibration: Any, args: argparse.Namespace) -> list[Setting]:
    cal = {"calibration": calibration}
    budget = args.budget // args.block_size
    window = max(args.chunk // args.block_size, 1)
    out = [
        Setting("fp32", {}, "dense, the model's own dtype"),
        Setting("fp16", {"codec": "fp16"}),
        Setting("bf16", {"codec": "bf16"}),
        Setting("int8", {"codec": "int8", **cal}, "keys per channel (calibrated), values per token"),
        Setting("nf4", {"codec": "nf4", **cal}, "keys per channel over 32 tokens (min/max), values per token "
                "(Hadamard-rotated NF4, groups of 32)"),
    ]
    if _has_mixed():
        out.append(Setting("mixed", {"codec": "mixed", **cal}, "recent and most-attended blocks fp16, the rest nf4"))
    for k in args.topk:
        out.append(Setting(f"topk{k}", {"topk": k, "sink_blocks": 1, "local_blocks": 1},
                           f"top-{k} blocks + sink + local block"))
    for k in args.topk_pages:  # the same selection at 64-token pages over the cache's 16-token blocks
        out.append(Setting(f"topk{k}-p64", {"topk": k, "sink_blocks": 1, "local_blocks": 1, "block_size": 16,
                                            "sparse_block_size": 64},
                           f"top-{k} pages of 64 tokens (cache blocks of 16) + sink page + local page"))
    out.append(Setting("streaming", {"importance": "streaming", "kv_budget_blocks": budget, "sink_blocks": 1,
                                     "local_blocks": window}, f"{args.budget}-token budget: sink + sliding window"))
    for t in args.merge:
        out.append(Setting(f"merge{t:g}", {"merge": t, "sink_blocks": 1, "local_blocks": 1},
                           f"adjacent tokens with key cosine >= {t:g} merged (per layer and KV head), "
                           "past the sink and local block"))
    out.append(Setting("h2o", {"importance": "h2o", "kv_budget_blocks": budget, "sink_blocks": 1,
                               "local_blocks": window}, f"{args.budget}-token budget: sink + window + heavy hitters"))
    return out


def _has_mixed() -> bool:
    """Whether the engine has mixed resolution (``codec="mixed"``)."""
    from kvdoctor.engine import config

    return getattr(config, "MIXED", None) == "mixed"


def texts(tokenizer: Any, context: int) -> dict[str, list[int]]:
    from kvdoctor.engine.kv.codecs import calibration_text

    pydoc = tokenizer(calibration_text())["input_ids"]
    pydoc = list(pydoc[len(pydoc) // 2 :])  # the half calibration never saw
    with open(LICENSE, encoding="utf-8") as fh:
        gpl = list(tokenizer(fh.read())["input_ids"])
    out = {"pydoc": pydoc[: context + 64], "GPL-3": gpl[: context + 64]}
    for name, ids in out.items():
        if len(ids) < context + 1:
            raise SystemExit(f"{name} has only {len(ids)} tokens; --context {context} needs {context + 1}")
    return out


@torch.inference_mode()
def evaluate(model: Any, ids: list[int], setting: Setting, args: argparse.Namespace) -> dict[str, Any]:
    """Perplexity over ``ids[:context]`` (chunked prefill), then decode steps for the bytes read."""
    from kvdoctor.engine.features.merging import TokenMerging
    from kvdoctor.engine.features.sparse import BlockSparse
    from kvdoctor.engine.serving.runner import Runner

    ctx = args.context
    config = {"block_size": args.block_size, **setting.config}
    blocks = -(-(ctx + args.decode) // config["block_size"])
    runner = Runner.create(model, stats_every=0, device_blocks=blocks + 2, host_blocks=0, **config)
    cache = runner.cache
    cache.add_sequence("text", prompt_len=ctx)
    nll, count = 0.0, 0
    t0 = time.perf_counter()
    for start in range(0, ctx, args.chunk):
        chunk = ids[start : min(start + args.chunk, ctx)]
        logits = runner.forward([("text", chunk)], all_logits=True)  # (n, V)
        target = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])
        logp = torch.log_softmax(logits[: len(target)], dim=-1)
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(target)
        cache.end_step()
    prefill_s = time.perf_counter() - t0
    resident = sum(t["used_bytes"] for t in cache.stats()["tiers"].values())
    resident_per_token = resident / cache.seq_len("text")
    # decode steps at the end of the context: bytes read per step
    c = cache.config
    read, dense = [], []
    for i in range(args.decode):
        runner.forward([("text", [ids[ctx + i]])])
        sparse = runner.feature(BlockSparse)
        if sparse is not None:
            read.append(sparse.bytes_read)
            dense.append(sparse.bytes_dense)
        else:  # dense attention reads every block, each in its own codec (mixed: fp16 or nf4)
            codecs = [cache.block(b).codec for b in cache.block_table("text")]
            read.append(sum(c.layout(codec).row_bytes for codec in codecs) * c.num_layers * c.num_kv_heads)
            dense.append(read[-1])
        cache.end_step()
    merging = runner.feature(TokenMerging)
    live, total = merging.live_rows("text") if merging is not None else (1, 1)
    runner.close()
    return {
        "live_share": live / total,
        "ppl": math.exp(nll / count),
        "tokens": count,
        "kv_bytes_per_token": resident_per_token,
        "kv_bytes_read_per_step": sum(read) / len(read),
        "read_share": sum(read) / sum(dense) if sum(dense) else 1.0,
        "seconds": prefill_s,
    }


@torch.inference_mode()
def key_similarity(model: Any, ids: list[int]) -> dict[str, Any]:
    """How alike adjacent keys are, as merging sees them: the cosine of each token's key with the previous
    token's, after RoPE (what the cache stores), per layer and KV head, over one forward pass of ``ids``."""
    cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).float()  # (L, H_kv, T, D)
    unit = torch.nn.functional.normalize(keys, dim=-1)
    cos = (unit[:, :, 1:] * unit[:, :, :-1]).sum(dim=-1).flatten()  # (L * H_kv * (T-1),)
    qs = [0.1, 0.25, 0.5, 0.75, 0.9]
    return {"pairs": cos.numel(), "quantiles": qs, "values": cos.quantile(torch.tensor(qs)).tolist(),
            "share_at_least": {t: float((cos >= t).float().mean()) for t in (0.8, 0.85, 0.9, 0.95)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=4096, help="tokens of context per text (default 4096)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--block-size", type=int, default=64, help="KV block size, also the sparse block (default 64)")
    p.add_argument("--topk", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 14],
                   help="top-k settings, comma-separated (default 4,8,14)")
    p.add_argument("--topk-pages", type=lambda s: [int(x) for x in s.split(",") if x], default=[8],
                   help="top-k settings over 64-token pages of 16-token cache blocks (default 8; '' for none)")
    p.add_argument("--budget", type=int, default=1024, help="eviction budget in tokens (default 1024)")
    p.add_argument("--decode", type=int, default=4, help="decode steps measured after the context (default 4)")
    p.add_argument("--merge", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.8, 0.85, 0.9, 0.95],
                   help="token merging thresholds, comma-separated (default 0.8,0.85,0.9,0.95; '' for none)")
    p.add_argument("--similarity", action="store_true",
                   help="also print the distribution of adjacent keys' cosine similarity on each text")
    p.add_argument("--only", help="comma-separated setting names to run (fp32 always runs: the baseline)")
    p.add_argument("--texts", default="pydoc,GPL-3", help="texts to evaluate (default pydoc,GPL-3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--skip-baseline", action="store_true", help="with --only: do not run fp32 first (changes "
                   "are then against the first setting run)")
    p.add_argument("--out", help="also write the rows measured so far to this JSON file after each setting")
    p.add_argument("--cal-samples", type=int, default=512, help="calibration windows (default 512)")
    p.add_argument("--cal-length", type=int, default=32, help="tokens per calibration window (default 32)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvdoctor.engine.kv.codecs import default_calibration
    from kvdoctor.engine.model.model import load_model

    t_start = time.perf_counter()
    loaded = load_model()
    t0 = time.perf_counter()
    calibration = default_calibration(loaded.model, loaded.tokenizer, name=loaded.name,
                                      num_samples=args.cal_samples, length=args.cal_length)
    cal_s = time.perf_counter() - t0
    data = {k: v for k, v in texts(loaded.tokenizer, args.context).items() if k in args.texts.split(",")}
    chosen = settings(calibration, args)
    if args.only:
        order = ([] if args.skip_baseline else ["fp32"]) + [n for n in args.only.split(",") if n != "fp32"]
        by_name = {s.name: s for s in chosen}
        chosen = [by_name[n] for n in order if n in by_name]
    rows = []
    for s in chosen:
        per_text = {name: evaluate(loaded.model, ids, s, args) for name, ids in data.items()}
        first = next(iter(per_text.values()))
        rows.append({"setting": s.name, "note": s.note, "texts": per_text,
                     "kv_bytes_per_token": first["kv_bytes_per_token"],
                     "kv_bytes_read_per_step": first["kv_bytes_read_per_step"], "read_share": first["read_share"],
                     "live_share": sum(r["live_share"] for r in per_text.values()) / len(per_text),
                     "seconds": sum(r["seconds"] for r in per_text.values())})
        print(f"# {s.name}: " + ", ".join(f"{n} ppl {r['ppl']:.4f}" for n, r in per_text.items())
              + f" ({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"calibration": calibration.source, "rows": rows}, fh, indent=1)
    base = rows[0]
    fp16_bytes = 2 * loaded.model.config.num_hidden_layers * loaded.model.config.num_key_value_heads * 2 * (
        loaded.model.config.hidden_size // loaded.model.config.num_attention_heads)
    for r in rows:
        r["ppl_change"] = sum(r["texts"][n]["ppl"] / base["texts"][n]["ppl"] - 1 for n in data) / len(data)
        r["bytes_vs_fp16"] = r["kv_bytes_per_token"] / fp16_bytes
    result = {"model": loaded.name, "context": args.context, "chunk": args.chunk, "block_size": args.block_size,
              "texts": {n: len(ids) for n, ids in data.items()}, "calibration": {
                  "samples": calibration.num_samples, "tokens": calibration.num_tokens, "source": calibration.source,
                  "digest": calibration.digest, "seconds": round(cal_s, 1)},
              "threads": torch.get_num_threads(), "rows": rows,
              **({"key_similarity": {n: key_similarity(loaded.model, ids[: args.context]) for n, ids in data.items()}}
                 if args.similarity else {}), "total_seconds": round(time.perf_counter() - t_start, 1)}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    names = list(data)
    head = ("| setting | " + " | ".join(f"ppl {n}" for n in names)
            + " | Δppl vs fp32 | KV B/token | vs fp16 | live | KV B/decode step | read share | s |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(f"| {r['setting']} | " + " | ".join(f"{r['texts'][n]['ppl']:.3f}" for n in names)
              + f" | {r['ppl_change'] * 100:+.2f}% | {r['kv_bytes_per_token']:.0f} | {r['bytes_vs_fp16']:.3f}x"
              + f" | {r['live_share'] * 100:.1f}%"
              + f" | {r['kv_bytes_read_per_step'] / 1e6:.2f} MB | {r['read_share'] * 100:.1f}% | {r['seconds']:.0f} |")
    print(f"\n{loaded.name}, context {args.context} tokens per text ({', '.join(names)}), prefill chunks of "
          f"{args.chunk}, block size {args.block_size}, {torch.get_num_threads()} threads; calibration "
          f"{calibration.num_samples} samples x {calibration.num_tokens // max(calibration.num_samples, 1)} tokens "
          f"({cal_s:.0f} s); total {result['total_seconds']:.0f} s")
    for name, q in result.get("key_similarity", {}).items():
        print(f"adjacent keys' cosine on {name} (per layer and KV head, {q['pairs']} pairs): "
              + ", ".join(f"p{int(p * 100)} {v:.3f}" for p, v in zip(q["quantiles"], q["values"]))
              + "; share >= " + ", ".join(f"{t:g}: {v * 100:.1f}%" for t, v in q["share_at_least"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
