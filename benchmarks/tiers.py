"""Tier benchmark: swap bandwidth per tier pair, allocation rate, and KV memory waste.

    .venv/bin/python benchmarks/tiers.py            # full run (about a minute on 2 cores)
    .venv/bin/python benchmarks/tiers.py --quick    # smaller, for a smoke test
    .venv/bin/python benchmarks/tiers.py --json out.json

1. Swap bandwidth: a batch of blocks moved with the engine's own swap path
   (bookkeeping, run-coalesced copies, checksum taken on the way out of a just-written
   block and verified on the way in) against a plain copy of the same bytes between the
   same two arenas, in the same run: a memcpy between host arenas, ``copy_`` with CUDA,
   and to or from the disk the arena's own reads and writes of the whole batch in the
   same I/O mode, without checksums or bookkeeping. Median of repeats; goal >= 0.9x.
   Printed with checksums on (the default) and off.
2. Allocation rate: blocks allocated and freed per second through the cache API
   (``reserve`` a whole block + ``commit`` + ``remove_sequence``), and decode-style
   one-token ``reserve`` + ``commit`` per second.
3. KV memory waste on a mixed-length continuous-batching workload: slots held but
   not filled, paged (this engine) against preallocating the maximum length per
   request. Goal: < 4% against 60-80%.
4. Disk I/O: write and read GB/s of the disk arena with O_DIRECT against buffered I/O,
   the same batch, interleaved; before each buffered read the page cache is dropped
   (``/proc/sys/vm/drop_caches``, root only; otherwise the files' pages are advised out
   with ``posix_fadvise``, which the output says).
5. Checksum kernels: copying a batch in host memory with its checksum taken by each
   candidate, against a plain memcpy (how ``engine/kv/checksum.py`` was chosen).

    .venv/bin/python benchmarks/tiers.py --disk-dir /work/tmp   # spill files on another filesystem
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

from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.kv.checksum import copy_sum, sum64_rows
from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.kv.storage import DiskArena

# SmolLM2-135M's cache shape: 30 layers, 3 KV heads of 64, fp16 -> 360 KiB per 16-token block
SHAPE = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float16")


def _cache(num_blocks: int, spill_dir: str, **kw: Any) -> PagedKVCache:
    cfg = EngineConfig(**SHAPE, device="auto", device_blocks=num_blocks, host_blocks=num_blocks,
                       disk_blocks=num_blocks, chunk_blocks=num_blocks, prefetch_depth=0, disk_dir=spill_dir, **kw)
    return PagedKVCache(cfg)


def _sync(cache: PagedKVCache) -> None:
    if cache.config.is_cuda:
        torch.cuda.synchronize()


def _move(cache: PagedKVCache, ids: list[int], dst: str) -> None:
    """The engine's swap of blocks ``ids`` to ``dst``, whichever way it goes."""
    if dst == "device":
        cache.swap_in(ids)
    else:
        cache.swap_out(ids, dst=dst)


def _rows(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().reshape(t.shape[0], -1)


def _plain_copy(dst: Any, src: Any, n: int) -> None:
    """The fastest plain copy of slots ``0 … n-1``: one memcpy on the CPU (numpy, single-threaded), ``copy_``
    with CUDA, and the disk arena's own write or read of the whole batch (its I/O mode, no checksum)."""
    if isinstance(dst, DiskArena):
        dst.write(0, _rows(src.view(0, n).cpu()))
    elif isinstance(src, DiskArena):
        out = dst.view(0, n)
        if out.device.type == "cpu":
            src.read(0, _rows(out))
        else:
            staged = torch.empty(out.shape, dtype=out.dtype)
            src.read(0, _rows(staged))
            out.copy_(staged)
    elif dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(_rows(dst.view(0, n)), _rows(src.view(0, n)))
    else:
        dst.view(0, n).copy_(src.view(0, n))


def swap_bandwidth(num_blocks: int, repeats: int, spill_dir: str, checksums: bool = True, disk_io: str = "auto"
                   ) -> list[dict]:
    """GB/s of the engine's swaps and of a plain copy, per tier pair, same bytes, same arenas."""
    cache = _cache(num_blocks, spill_dir, checksums=checksums, disk_io=disk_io)
    try:
        cache.add_sequence("s")
        slots = cache.reserve("s", num_blocks * cache.block_size)
        cache.commit("s")
        cache.layer_kv(0)  # touch
        cache.preallocate()  # grow every arena to full size up front, like a warm engine
        for t in cache.config.tiers:
            cache.arenas[t].view(0, cache.arenas[t].num_slots).view(torch.int16).random_(-30000, 30000)
        ids = cache.block_table("s")
        blocks = [cache.block(i) for i in ids]
        nbytes = num_blocks * cache.config.bytes_per_block
        pairs = [("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"),
                 ("device", "disk"), ("disk", "device")]
        out = []
        for src, dst in pairs:
            swap_s, copy_s = [], []
            a_src, a_dst = cache.arenas[src], cache.arenas[dst]
            for rep in range(repeats):
                _move(cache, ids, src)  # start from src, outside the timing
                for b in blocks:
                    b.checksum = None if src == "device" else b.checksum  # just written: swap-out must checksum
                for run_swap in ((True, False) if rep % 2 else (False, True)):  # alternate which goes first
                    _sync(cache)
                    t0 = time.perf_counter()
                    if run_swap:
                        _move(cache, ids, dst)
                    else:  # the plain copy: the same bytes between the same two arenas, in one call
                        _plain_copy(a_dst, a_src, num_blocks)
                    _sync(cache)
                    (swap_s if run_swap else copy_s).append(time.perf_counter() - t0)
            swap = nbytes / statistics.median(swap_s) / 1e9
            copy = nbytes / statistics.median(copy_s) / 1e9
            out.append({"src": src, "dst": dst, "bytes": nbytes, "swap_gbs": swap, "copy_gbs": copy, "ratio": swap / copy,
                        "disk_io": cache.arenas["disk"].io})
        return out
    finally:
        cache.close()


def drop_page_cache(arena: DiskArena) -> str:
    """Flush the arena's spill files and evict their pages before a buffered read; says how it went."""
    fds = [os.open(arena.path(c), os.O_RDONLY) for c in range(-(-arena.num_slots // arena.chunk))]
    try:
        for fd in fds:
            os.fdatasync(fd)  # dirty pages cannot be dropped
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            return "dropped before each buffered read (/proc/sys/vm/drop_caches)"
        except OSError as exc:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return (f"NOT dropped: /proc/sys/vm/drop_caches needs root ({exc.strerror}); the spill files' pages were "
                    "advised out with posix_fadvise(DONTNEED) instead, which the kernel may ignore in part: the "
                    "buffered read figure may partly come from memory and overstate the disk")
    finally:
        for fd in fds:
            os.close(fd)


def disk_io(num_blocks: int, repeats: int, spill_dir: str) -> dict:
    """Write and read GB/s of the disk arena, O_DIRECT against buffered, the same batch, interleaved."""
    arenas = {}
    for mode in ("direct", "buffered"):
        cfg = EngineConfig(**SHAPE, device_blocks=1, host_blocks=0, disk_blocks=num_blocks, chunk_blocks=num_blocks,
                           disk_dir=spill_dir, disk_io=mode)
        arenas[mode] = a = DiskArena("disk", cfg)
        a.grow()
    try:
        bpb = arenas["direct"].bytes_per_block
        src = np.random.default_rng(0).integers(0, 256, (num_blocks, bpb), dtype=np.uint8)
        dst = np.empty_like(src)
        times: dict[str, list[float]] = {}
        cache_note = ""
        for rep in range(repeats):
            for mode in (("direct", "buffered") if rep % 2 else ("buffered", "direct")):
                a = arenas[mode]
                t0 = time.perf_counter()
                a.write(0, src)
                t1 = time.perf_counter()
                if mode == "buffered":
                    for c in range(-(-a.num_slots // a.chunk)):
                        fd = os.open(a.path(c), os.O_RDONLY)
                        os.fdatasync(fd)
                        os.close(fd)
                    times.setdefault("buffered_flush", []).append(time.perf_counter() - t1)
                    cache_note = drop_page_cache(a)
                t2 = time.perf_counter()
                a.read(0, dst)
                times.setdefault(f"{mode}_read", []).append(time.perf_counter() - t2)
                times.setdefault(f"{mode}_write", []).append(t1 - t0)
                assert np.array_equal(dst, src), f"{mode}: the bytes read back differ from those written"
        nbytes = src.nbytes
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        gbs["buffered_write_flushed"] = nbytes / statistics.median(
            [w + f for w, f in zip(times["buffered_write"], times["buffered_flush"])]) / 1e9
        del gbs["buffered_flush"]
        return {"bytes": nbytes, "dir": spill_dir, "gbs": gbs, "page_cache": cache_note}
    finally:
        for a in arenas.values():
            a.close()


def checksum_kernels(num_blocks: int, repeats: int) -> list[dict]:
    """A batch copied in host memory with its checksum taken by each candidate, against a plain memcpy."""
    bpb = EngineConfig(**SHAPE).bytes_per_block
    src = np.random.default_rng(0).integers(0, 256, (num_blocks, bpb), dtype=np.uint8)
    dst = np.empty_like(src)

    def then(hash_rows: Any) -> Any:  # copy two blocks (720 KiB: in cache), then hash them there
        def run() -> None:
            for i in range(0, num_blocks, 2):
                np.copyto(dst[i : i + 2], src[i : i + 2])
                hash_rows(dst[i : i + 2])
        return run

    kernels = {"memcpy, no checksum": lambda: np.copyto(dst, src),
               "one pass, store + add (the engine's)": lambda: copy_sum(dst, src),
               "memcpy, then word sum from cache (numpy: the engine without a C compiler)": then(sum64_rows)}
    try:
        import xxhash
        kernels["memcpy, then xxh3_64 from cache (xxhash)"] = then(lambda r: [xxhash.xxh3_64_intdigest(x) for x in r])
    except ImportError:
        pass
    try:
        import crc32c
        kernels["memcpy, then CRC32C from cache (crc32c)"] = then(lambda r: [crc32c.crc32c(x) for x in r])
    except ImportError:
        pass
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for rep in range(repeats):
        for name in (list(kernels) if rep % 2 else list(reversed(kernels))):
            t0 = time.perf_counter()
            kernels[name]()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["memcpy, no checksum"])
    return [{"kernel": k, "gbs": src.nbytes / statistics.median(v) / 1e9, "ratio": base / statistics.median(v)}
            for k, v in times.items()]


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


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"cpu={cpu}, cpus={os.cpu_count()}, load average={' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per swap batch (default 256 = 90 MiB, beyond the L3 cache; quick 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per pair (default 15, quick 5)")
    ap.add_argument("--disk-dir", default=None, help="where the spill files go (default: the system temp dir)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    nblocks = args.blocks or (16 if args.quick else 256)
    repeats = args.repeats or (5 if args.quick else 15)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvd-bench-", dir=args.disk_dir) as spill:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"kvdoctor tier benchmark: device={device}, torch threads={torch.get_num_threads()}, {_machine()}, "
              f"block={SHAPE}, spill files in {spill}")
        bw = swap_bandwidth(nblocks, repeats, spill)
        raw = swap_bandwidth(nblocks, repeats, spill, checksums=False)
        print(f"\nswap bandwidth, {nblocks} blocks = {bw[0]['bytes'] / 2**20:.1f} MiB per batch, median of {repeats}, "
              f"disk I/O {bw[0]['disk_io']}")
        print(f"{'pair':<16}{'swap GB/s':>11}{'copy GB/s':>11}{'ratio':>8}   {'without checksums: swap':>24}{'copy':>7}{'ratio':>7}")
        for r, q in zip(bw, raw):
            print(f"{r['src'] + '->' + r['dst']:<16}{r['swap_gbs']:>11.2f}{r['copy_gbs']:>11.2f}{r['ratio']:>8.2f}"
                  f"   {q['swap_gbs']:>24.2f}{q['copy_gbs']:>7.2f}{q['ratio']:>7.2f}")
        io = disk_io(nblocks, max(3, repeats // 3), spill)
        g = io["gbs"]
        print(f"\ndisk I/O, {io['bytes'] / 2**20:.1f} MiB, median of {max(3, repeats // 3)}: "
              f"O_DIRECT write {g['direct_write']:.2f} GB/s, read {g['direct_read']:.2f} GB/s; "
              f"buffered write {g['buffered_write']:.2f} GB/s (into the page cache; {g['buffered_write_flushed']:.2f} "
              f"with the flush), read {g['buffered_read']:.2f} GB/s")
        print(f"page cache: {io['page_cache']}")
        kern = checksum_kernels(nblocks, repeats)
        print(f"\nchecksum kernels, {nblocks} blocks in host memory, median of {repeats}")
        for k in kern:
            print(f"{k['kernel']:<48}{k['gbs']:>7.2f} GB/s{k['ratio']:>7.2f}x")
        alloc = allocation_rate(0.5 if args.quick else 2.0, spill)
        print(f"\nallocation: {alloc['block_alloc_free_per_s']:,.0f} blocks alloc+free/s; "
              f"{alloc['decode_reserve_commit_per_s']:,.0f} decode reserve+commit/s")
        waste = memory_waste(16 if args.quick else 32, 2048, 200 if args.quick else 1500, 0, spill)
        print(f"\nKV memory waste ({waste['requests']} requests, {waste['live']} live, max length {waste['max_len']}): "
              f"paged {waste['paged_waste']:.2%} vs max-length preallocation {waste['prealloc_waste']:.2%}")
        print(f"\nat the end: {_machine()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"swap": bw, "swap_without_checksums": raw, "disk_io": io, "checksum_kernels": kern,
                       "allocation": alloc, "waste": waste}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
