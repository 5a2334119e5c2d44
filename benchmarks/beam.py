"""KV memory of beam search on EngineCache against transformers' DynamicCache, on the embedded SmolLM2.

DynamicCache holds one copy of every token per beam. EngineCache's beams share the blocks they
have in common (after the first reorder, the whole prompt and every token before the beams
diverged) and copy a shared partial block only when one of them writes into it. Reported: the
KV bytes each cache holds when generate returns, the engine's peak (at the prefill, where
transformers computes the prompt once per beam), the blocks allocated against the blocks the
rows hold (what an unshared paged cache would need), and whether the tokens are identical.
Memory only: wall times on a shared machine say nothing here.

Usage::

    .venv/bin/python benchmarks/beam.py [--beams 4] [--new-tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import json

PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who had never "
          "left the harbour. Every morning he")


def measure(beams: int, new_tokens: int) -> dict[str, object]:
    from transformers import DynamicCache

    from kvdoctor.engine.model.hf import EngineCache
    from kvdoctor.engine.model.model import load_model

    smol = load_model()
    model = smol.model
    batch = smol.tokenizer([PROMPT], return_tensors="pt")
    options = dict(max_new_tokens=new_tokens, num_beams=beams, do_sample=False)
    dyn = DynamicCache(config=model.config)
    ref = model.generate(**batch, cache=dyn, **options)
    dyn_bytes = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in dyn.layers)
    with EngineCache(model, device_blocks=64 * beams, host_blocks=0) as cache:
        out = model.generate(**batch, cache=cache, **options)
        eng = cache.engine
        stats = eng.stats()
        held = sum(len(eng.blocks_of(seq)) for seq in cache.seqs)
        peak = stats["peak_kv_bytes"]
    return {
        "prompt_tokens": int(batch["input_ids"].shape[1]), "beams": beams, "new_tokens": new_tokens,
        "identical_tokens": out.tolist() == ref.tolist(),
        "dynamic_cache_bytes": dyn_bytes, "engine_bytes": stats["kv_bytes"], "engine_peak_bytes": peak,
        "engine_blocks": stats["blocks"], "row_held_blocks": held,
        "bytes_ratio": dyn_bytes / stats["kv_bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = measure(args.beams, args.new_tokens)
    if args.json:
        print(json.dumps(r))
        return
    print(f"SmolLM2-135M, prompt {r['prompt_tokens']} tokens, {r['beams']} beams, {r['new_tokens']} new tokens; "
          f"identical tokens: {r['identical_tokens']}")
    print(f"KV held when generate returns: DynamicCache {r['dynamic_cache_bytes'] / 1e6:.2f} MB, "
          f"EngineCache {r['engine_bytes'] / 1e6:.2f} MB ({r['bytes_ratio']:.2f}x less; peak {r['engine_peak_bytes'] / 1e6:.2f} MB)")
    print(f"blocks allocated {r['engine_blocks']}, held by the rows {r['row_held_blocks']} (unshared)")


if __name__ == "__main__":
    main()
