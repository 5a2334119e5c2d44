"""Tier benchmark: swap bandwidth per tier pair, allocation rate, and KV memory waste.

    .venv/bin/python benchmarks/tiers.py            # full run (about a minute on 2 cores)
    .venv/bin/python benchmarks/tiers.py --quick    # smaller, for a smoke test
    .venv/bin/python benchmarks/tiers.py --json out.json

1. Swap bandwidth: a batch of blocks moved with the engine's own swap path
   (bookkeeping, run-coalesced copies, checksum taken on the way out of a just-written
   block and verified on the way in) against a plain ``copy_`` of the same bytes
   between the same two arenas, in the same run. Median of repeats; goal >= 0.8x.
2. Allocation rate: blocks allocated and freed per second through the cache API
   (``reserve`` a whole block + ``commit`` + ``remove_sequence``), and decode-style
   one-token ``reserve`` + ``commit`` per second.
3. KV memory waste on a mixed-length continuous-batching workload: slots held but
   not filled, paged (this engine) against preallocating the maximum length per
   request. Goal: < 4% against 60-80%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from kvdoctor.engine.cache import PagedKVCache
from kvdoctor.engine.config import EngineConfig

# SmolLM2-135M's cache shape: 30 layers, 3 KV heads of 64, fp16 -> 360 KiB per 16-token block
SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float16")


def _cache(num_blocks: int, spill_dir: str, **kw: Any) -> PagedKVCache:
    cfg = EngineConfig(**SHAPE, device="auto", device_blocks=num_blocks, host_blocks=num_blocks,
                       disk_blocks=num_blocks, chunk_blocks=num_blocks, prefetch_depth=0, disk_dir=spill_dir, **kw)
    return PagedKVCache(cfg)


def _sync(cache: PagedKVCache) -> None:
    if cache.config.is_cuda:
        torch.cuda.synchronize()


def _plain_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The fastest plain copy: one memcpy on the CPU (numpy, single-threaded), ``copy_`` with CUDA."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def swap_bandwidth(num_blocks: int, repeats: int, spill_dir: str, checksums: bool = True) -> list[dict]:
    """GB/s of the engine's swaps and of a plain copy, per tier pair, same bytes, same arenas."""
    cache = _cache(num_blocks, spill_dir, checksums=checksums)
    try:
        cache.add_sequence("s")
        slots = cache.reserve("s", num_blocks * cache.block_size)
        cache.commit("s")
        cache.layer_kv(0)  # touch
        for t in cache.config.tiers:  # grow every arena to full size up front, like a warm engine
            a = cache.arenas[t]
            while a.num_slots < a.capacity:
                cache.pool.tiers[t].grown += len(r := a.grow())
                cache.pool.tiers[t].free_slots.extend(r)
        for t in cache.config.tiers:
            cache.arenas[t].view(0, cache.arenas[t].num_slots).view(torch.int16).random_(-30000, 30000)
        blocks = [cache.pool.blocks[i] for i in cache.block_table("s")]
        nbytes = num_blocks * cache.config.bytes_per_block
        pairs = [("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"),
                 ("device", "disk"), ("disk", "device")]
        out = []
        for src, dst in pairs:
            swap_s, copy_s = [], []
            a_src, a_dst = cache.arenas[src], cache.arenas[dst]
            for rep in range(repeats):
                cache.tiers.move(blocks, src)  # start from src, outside the timing
                for b in blocks:
                    b.checksum = None if src == "device" else b.checksum  # just written: swap-out must checksum
                for run_swap in ((True, False) if rep % 2 else (False, True)):  # alternate which goes first
                    _sync(cache)
                    t0 = time.perf_counter()
                    if run_swap:
                        cache.tiers.move(blocks, dst)
                    else:  # the plain copy: the same bytes between the same two arenas, in one call
                        _plain_copy(a_dst.view(0, num_blocks), a_src.view(0, num_blocks))
                    _sync(cache)
                    (swap_s if run_swap else copy_s).append(time.perf_counter() - t0)
            swap = nbytes / statistics.median(swap_s) / 1e9
            copy = nbytes / statistics.median(copy_s) / 1e9
            out.append({"src": src, "dst": dst, "bytes": nbytes, "swap_gbs": swap, "copy_gbs": copy, "ratio": swap / copy})
        return out
    finally:
        cache.close()


def allocation_rate(seconds: float, spill_dir: str) -> dict:
    cache = _cache(128, spill_dir)
    try:
        bs = cache.block_size

        def cycle() -> None:
            for i in range(64):
                cache.add_sequence(i)
                cache.reserve(i, bs)
                cache.commit(i)
            for i in range(64):
                cache.remove_sequence(i)
            cache.end_step()

        cycle()  # the arena grows on first use: not part of the rate
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            cycle()
            n += 64
        blocks_per_s = n / (time.perf_counter() - t0)
        cache.add_sequence("d")
        m = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(256):
                cache.reserve("d", 1)
                cache.commit("d", 1)
            m += 256
            cache.rollback("d", 256)
            cache.end_step()
        tokens_per_s = m / (time.perf_counter() - t0)
        return {"block_alloc_free_per_s": blocks_per_s, "decode_reserve_commit_per_s": tokens_per_s}
    finally:
        cache.close()


def memory_waste(num_live: int, max_len: int, steps: int, seed: int, spill_dir: str) -> dict:
    """Time-averaged share of held KV slots that hold no token, paged vs max-length preallocation."""
    rng = random.Random(seed)

    def request() -> tuple[int, int]:
        # chat-like lengths: log-normal prompts and outputs, capped so prompt + output <= max_len
        p = min(max(int(rng.lognormvariate(5.3, 0.8)), 4), max_len // 2)
        o = min(max(int(rng.lognormvariate(5.0, 0.9)), 1), max_len - p)
        return p, o

    blocks = num_live * (-(-max_len // SHAPE["block_size"]))
    cache = _cache(blocks, spill_dir)
    try:
        live: dict[int, list[int]] = {}
        next_id = 0
        paged, prealloc = [], []
        for _ in range(steps):
            while len(live) < num_live:
                p, o = request()
                cache.add_sequence(next_id, p)
                cache.reserve(next_id, p)
                cache.commit(next_id)
                live[next_id] = [o]
                next_id += 1
            for seq, left in list(live.items()):
                cache.reserve(seq, 1)
                cache.commit(seq, 1)
                left[0] -= 1
                if left[0] == 0:
                    cache.remove_sequence(seq)
                    del live[seq]
            st = cache.stats()
            tokens = sum(cache.seq_len(s) for s in live)
            held = st["tiers"]["device"]["used_blocks"] * cache.block_size
            paged.append(1 - tokens / held)
            prealloc.append(1 - tokens / (len(live) * max_len))
            cache.end_step()
        return {"requests": next_id, "live": num_live, "max_len": max_len,
                "paged_waste": statistics.fmean(paged), "prealloc_waste": statistics.fmean(prealloc)}
    finally:
        cache.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per swap batch (default 256 = 90 MiB, beyond the L3 cache; quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per pair (default 15, quick 5)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    nblocks = args.blocks or (16 if args.quick else 256)
    repeats = args.repeats or (5 if args.quick else 15)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-") as spill:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"kvdoctor tier benchmark: device={device}, torch threads={torch.get_num_threads()}, "
              f"cpus={os.cpu_count()}, block={SHAPE}")
        bw = swap_bandwidth(nblocks, repeats, spill)
        raw = swap_bandwidth(nblocks, repeats, spill, checksums=False)
        print(f"\nswap bandwidth, {nblocks} blocks = {bw[0]['bytes'] / 2**20:.1f} MiB per batch, median of {repeats}")
        print(f"{'pair':<16}{'swap GB/s':>11}{'copy GB/s':>11}{'ratio':>8}   {'without checksums: swap':>24}{'copy':>7}{'ratio':>7}")
        for r, q in zip(bw, raw):
            print(f"{r['src'] + '->' + r['dst']:<16}{r['swap_gbs']:>11.2f}{r['copy_gbs']:>11.2f}{r['ratio']:>8.2f}"
                  f"   {q['swap_gbs']:>24.2f}{q['copy_gbs']:>7.2f}{q['ratio']:>7.2f}")
        alloc = allocation_rate(0.5 if args.quick else 2.0, spill)
        print(f"\nallocation: {alloc['block_alloc_free_per_s']:,.0f} blocks alloc+free/s; "
              f"{alloc['decode_reserve_commit_per_s']:,.0f} decode reserve+commit/s")
        waste = memory_waste(16 if args.quick else 32, 2048, 200 if args.quick else 1500, 0, spill)
        print(f"\nKV memory waste ({waste['requests']} requests, {waste['live']} live, max length {waste['max_len']}): "
              f"paged {waste['paged_waste']:.2%} vs max-length preallocation {waste['prealloc_waste']:.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"swap": bw, "swap_without_checksums": raw, "allocation": alloc, "waste": waste}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
