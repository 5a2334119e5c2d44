"""Soak: thousands of short requests through the real PagedKVCache — random lengths, aborts
(also while swapped out), forks, rollbacks, swaps through host and disk, evictions — must
raise no finding at all and leave every tier as it found it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from kvdoctor.checks import make_suite  # noqa: E402
from kvdoctor.engine.kv.cache import PagedKVCache  # noqa: E402
from kvdoctor.engine.config import EngineConfig  # noqa: E402
from kvdoctor.engine.errors import OutOfBlocks  # noqa: E402

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 1, 4


def tiny_cache(fault: str | None = None, **tiers) -> PagedKVCache:
    sizes = {"device_blocks": 24, "host_blocks": 12, "disk_blocks": 12, **tiers}
    cfg = EngineConfig(num_layers=NUM_LAYERS, num_kv_heads=NUM_HEADS, head_dim=HEAD_DIM, block_size=4,
                       dtype="float32", fault=fault, **sizes)
    return PagedKVCache(cfg)


def append(cache: PagedKVCache, seq, n: int) -> None:
    """What a model step does to the cache: reserve, store K/V in every layer, commit."""
    slots = cache.reserve(seq, n)
    for layer in range(NUM_LAYERS):
        kv = torch.randn(n, NUM_HEADS, HEAD_DIM)  # (N, H_kv, D)
        cache.store(layer, slots, kv, kv)
    cache.commit(seq)


def soak(cache: PagedKVCache, num_requests: int, seed: int = 0) -> Counter:
    """Drive ``cache`` like a busy server; returns how many events of each kind it emitted."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kinds: Counter = Counter()
    cache.bus.subscribe(lambda evs: kinds.update(type(e).__name__ for e in evs))
    live: dict[int, int] = {}  # seq -> tokens still to generate
    next_id = finished = 0
    while finished < num_requests or live:
        while finished + len(live) < num_requests and len(live) < 6 and rng.random() < 0.6:
            seq, next_id = next_id, next_id + 1
            prompt = rng.randint(1, 14)
            cache.add_sequence(seq, prompt_len=prompt)
            try:
                append(cache, seq, prompt)
                cache.emit_read(seq, layer=0)
                live[seq] = rng.randint(1, 12)
            except OutOfBlocks:
                cache.remove_sequence(seq, reason="aborted")
                finished += 1
        for seq in list(live):
            r = rng.random()
            try:
                if r < 0.04 and len(live) < 9:  # fork: a child shares the prefix
                    child, next_id = next_id, next_id + 1
                    cache.fork(seq, child)
                    live[child] = rng.randint(1, 6)
                elif r < 0.12 and cache.seq_len(seq) > 1:  # rejected speculation
                    cache.rollback(seq, rng.randint(1, min(3, cache.seq_len(seq) - 1)))
                elif r < 0.22:  # preemption by swap
                    blocks = cache.block_table(seq)
                    if blocks:
                        cache.swap_out(blocks, dst=rng.choice(["host", "disk"]))
                    if rng.random() < 0.3:  # the client gives up while it is swapped out
                        cache.remove_sequence(seq, reason="aborted")
                        del live[seq]
                        finished += 1
                    continue
                cache.ensure_resident([seq])
                append(cache, seq, rng.choice([1, 1, 1, 2, 4]))
                cache.emit_read(seq, layer=rng.randrange(NUM_LAYERS))
                live[seq] -= 1
            except OutOfBlocks:
                pass
            if live[seq] <= 0 or rng.random() < 0.03:
                cache.remove_sequence(seq, reason="finished" if live[seq] <= 0 else "aborted")
                del live[seq]
                finished += 1
        cache.end_step(len(live))
    cache.bus.flush()
    return kinds


def occupancy(cache: PagedKVCache) -> dict[str, int]:
    return {t: v["used_blocks"] for t, v in cache.stats()["tiers"].items()}


def test_soak_of_2000_requests_raises_nothing_and_returns_every_tier():
    # GIVEN a tiny cache with every check listening
    cache = tiny_cache()
    suite = make_suite()
    cache.bus.subscribe(suite.observe_many)
    start = occupancy(cache)
    # WHEN 2000 short requests go through it
    kinds = soak(cache, 2000)
    end = occupancy(cache)
    cache.close()
    suite.finish()
    # THEN nothing was flagged, every tier is back where it started, and the run really
    # exercised what the checks must not flag
    assert [f.message for f in suite.findings] == []
    assert end == start
    assert kinds["SeqEnd"] >= 2000
    for kind in ("SwapOut", "SwapIn", "Share", "Release", "Rollback", "Free", "Evict", "Read", "Usage"):
        assert kinds[kind] > 0, kind
