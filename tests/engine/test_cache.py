"""PagedKVCache: the runner's API, tier movement under pressure, and the events it records."""

from __future__ import annotations

import os

import pytest
import torch

from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.errors import OutOfBlocks, UnknownSequence


def test_write_gather_round_trip_and_write_events(make_cache):
    r = make_cache()
    # GIVEN a 6-token prompt in blocks of 4
    r.add("a", 6)
    # THEN gather returns exactly the K/V stored, (H, T, D)
    r.assert_intact("a")
    assert r.cache.gather("a", 0)[0].shape == (2, 6, 8)
    # AND one write per block advances the version by the tokens written
    w = r.kinds("write")
    assert [(e.block, e.pos, e.n, e.version) for e in w] == [(0, 0, 4, 4), (1, 4, 2, 6)]
    assert r.cache.version("a") == 6 and r.cache.seq_len("a") == 6
    assert [e.tier for e in r.kinds("alloc")] == ["device", "device"]


def test_decode_appends_into_the_partial_block(make_cache):
    r = make_cache()
    r.add("a", 3)
    for _ in range(3):
        r.write("a", 1)
    assert r.cache.block_table("a") == [0, 1]
    r.assert_intact("a")
    assert [e.version for e in r.kinds("write")] == [3, 4, 5, 6]


def test_gather_includes_stored_but_uncommitted_tokens(make_cache):
    r = make_cache()
    r.add("a", 2)
    slots = r.cache.reserve("a", 1)
    k = torch.ones(1, 2, 8)
    for layer in range(2):
        r.cache.store(layer, slots, k, k)
    assert r.cache.gather("a", 1)[0].shape[1] == 3 and r.cache.version("a") == 2
    r.cache.commit("a")
    assert r.cache.version("a") == 3


def test_pressure_swaps_through_host_and_disk_and_back(make_cache):
    # GIVEN a device of 4 blocks and a host of 4, and five 2-block sequences
    r = make_cache()
    for i in range(5):
        r.add(i, 8)
        r.cache.end_step()
    # THEN the oldest went device -> host -> disk, each keeping its version
    assert r.cache.stats()["tiers"]["disk"]["used_blocks"] == 2
    outs = r.kinds("swap_out")
    assert {(e.src, e.dst) for e in outs} == {("device", "host"), ("host", "disk")}
    # WHEN every sequence is read back THEN the bytes are intact through the chain
    for i in range(5):
        r.assert_intact(i)
        r.cache.end_step()
    ins = r.kinds("swap_in")
    assert ("disk", "device") in {(e.src, e.dst) for e in ins}
    last_write = {e.block: e.version for e in r.kinds("write")}
    assert all(e.version == last_write[e.block] for e in outs + ins)
    r.cache.pool.check()


def test_copy_on_write_of_a_shared_partial_block(make_cache):
    r = make_cache()
    r.add("p", 6)  # blocks 0 (full) and 1 (2 of 4)
    r.fork("p", "c")
    assert [e.block for e in r.kinds("share")] == [0, 1]
    # WHEN the child appends into the shared partial block
    r.write("c", 1)
    # THEN it got a private copy; the parent's block is untouched
    assert r.cache.block_table("p") == [0, 1] and r.cache.block_table("c") == [0, 2]
    assert [(e.block, e.seq) for e in r.kinds("release")] == [(1, "c")]
    assert r.kinds("write")[-1].block == 2
    r.assert_intact("p")
    r.assert_intact("c")
    # AND a parent append after the fork does not disturb the child either
    r.write("p", 2)
    r.assert_intact("p")
    r.assert_intact("c")


def test_adopt_moves_ownership_of_the_differing_blocks_only(make_cache):
    # GIVEN two beams of one prompt: they share block 0 and each has its own tail
    r = make_cache(device_blocks=8)
    r.add("a", 5)  # blocks 0 (full) and 1 (1 of 4)
    r.fork("a", "b")
    r.write("b", 1)  # b copies block 1 before writing: blocks 0 and 2
    r.write("a", 1)
    r.cache.bus.flush()
    before = len(r.events)
    # WHEN b takes over a's hypothesis (beam search's reorder)
    r.cache.adopt("b", "a")
    r.kv["b"] = list(r.kv["a"])
    # THEN b shares a's tail and lets go of its own, which is freed; the common block sees no event
    r.cache.bus.flush()
    moved = [(type(e).__struct_config__.tag, e.block, getattr(e, "seq", None)) for e in r.events[before:]]
    assert moved == [("share", 1, "b"), ("release", 2, "b"), ("free", 2, None)]
    assert r.cache.block_table("b") == r.cache.block_table("a") == [0, 1]
    assert r.cache.pool.blocks[1].owners == ["a", "b"]
    r.assert_intact("b")
    # AND b's next token goes into its own copy of the shared tail, leaving a's intact
    r.write("b", 1)
    r.assert_intact("a")
    r.assert_intact("b")
    r.cache.pool.check()


def test_adopt_needs_equal_committed_lengths(make_cache):
    r = make_cache(device_blocks=8)
    r.add("a", 5)
    r.add("b", 3)
    with pytest.raises(ValueError, match="lengths must match"):
        r.cache.adopt("b", "a")
    r.cache.reserve("a", 1)
    with pytest.raises(ValueError, match="not committed"):
        r.cache.adopt("b", "a")


def test_rollback_drops_tail_blocks_and_advances_version(make_cache):
    r = make_cache()
    r.add("a", 9)  # three blocks
    r.rollback("a", 2)
    assert r.cache.version("a") == 11 and r.cache.seq_len("a") == 7
    assert [(e.n, e.version) for e in r.kinds("rollback")] == [(2, 11)]
    assert [e.block for e in r.kinds("free")] == [2]
    r.write("a", 3)
    r.assert_intact("a")
    with pytest.raises(ValueError, match=r"\[1, 10\]"):
        r.cache.rollback("a", 11)


def test_remove_sequence_frees_everything_in_every_tier(make_cache):
    r = make_cache()
    for i in range(5):
        r.add(i, 8)
        r.cache.end_step()
    r.fork(4, "f")
    for i in [0, 1, 2, 3, 4, "f"]:
        r.cache.remove_sequence(i)
    r.cache.end_step()
    st = r.cache.stats()
    assert st["blocks"] == 0 and all(t["used_blocks"] == 0 for t in st["tiers"].values())
    freed = {e.block for e in r.kinds("free")}
    assert freed == {e.block for e in r.kinds("alloc")}
    usage = r.kinds("usage")[-3:]
    assert [u.used_blocks for u in usage] == [0, 0, 0]


def test_eviction_only_when_every_tier_is_full_and_never_the_tail(make_cache):
    # GIVEN device 2 + host 2 and no disk
    r = make_cache(device_blocks=2, host_blocks=2, disk_blocks=0)
    r.add("a", 8)
    r.cache.end_step()
    r.add("b", 8)  # a's two blocks go to host
    r.cache.end_step()
    assert not r.kinds("evict")
    # WHEN a third sequence needs room THEN b goes to host and host evicts a's non-tail block
    r.add("c", 4)
    r.cache.end_step()
    ev = r.kinds("evict")
    assert [(e.block, e.tier, e.reason) for e in ev] == [(0, "host", "capacity")]
    assert r.cache.block_table("a") == [1]
    r.assert_intact("a")  # gather skips the evicted block's tokens
    r.cache.pool.check()


def test_out_of_blocks_carries_the_numbers(make_cache):
    r = make_cache(device_blocks=2, host_blocks=0, disk_blocks=0)
    r.cache.add_sequence("a")
    with pytest.raises(OutOfBlocks) as exc:
        r.cache.reserve("a", 12)
    assert (exc.value.tier, exc.value.requested, exc.value.free) == ("device", 3, 2)
    r.cache.pool.check()
    assert r.cache.stats()["blocks"] == 0


def test_pinned_sequences_are_never_victims(make_cache):
    r = make_cache(device_blocks=4, host_blocks=4)
    r.add("a", 8)
    r.add("b", 8)  # same step: both pinned, device full
    with pytest.raises(OutOfBlocks):
        r.add("c", 1)
    r.cache.end_step()
    r.write("c", 1)  # next step: nothing is pinned but c, so one of a's or b's blocks goes to host
    (out,) = r.kinds("swap_out")
    assert r.cache.pool.blocks[out.block].owners in (["a"], ["b"])


def test_prefetch_brings_blocks_up_in_the_background_and_counts_hits(make_cache):
    r = make_cache(prefetch_depth=8)
    r.add("a", 8)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "host")
    # WHEN a scheduler prefetches a, then runs it
    assert r.cache.prefetch("a") == 2
    assert r.kinds("prefetch")[0].blocks == [0, 1]
    r.assert_intact("a")
    # THEN both blocks count as hits and arrive as swap_in events
    st = r.cache.stats()
    assert (st["prefetch_hits"], st["prefetch_misses"], st["prefetch_hit_rate"]) == (2, 0, 1.0)
    assert [(e.block, e.src, e.dst) for e in r.kinds("swap_in")] == [(0, "host", "device"), (1, "host", "device")]
    # AND a sequence fetched on demand counts as misses
    r.cache.end_step()
    r.cache.swap_out([0], "disk")
    r.assert_intact("a")
    assert r.cache.stats()["prefetch_misses"] == 1


def test_read_events_carry_versions_of_the_copies_read(make_cache):
    r = make_cache()
    r.add("a", 5)
    r.cache.emit_read("a", layer=0)
    (e,) = r.kinds("read")
    assert (e.blocks, e.versions, e.layer) == ([0, 1], [4, 5], 0)


def test_hybrid_policy_demotes_far_unimportant_blocks_first(make_cache):
    r = make_cache(eviction="hybrid", recency_weight=0.0, distance_weight=1.0, importance_weight=1.0,
                   device_blocks=4, host_blocks=8)
    r.add("a", 16)  # four blocks
    r.cache.observe_attention("a", 0, [5.0, 0.0, 0.0, 1.0])  # a sink on block 0
    r.cache.end_step()
    r.add("b", 4)  # needs one block: the victim is far from a's end but not the sink
    assert [e.block for e in r.kinds("swap_out")] == [1]


def test_unknown_sequence_and_bad_blocks(make_cache):
    r = make_cache()
    with pytest.raises(UnknownSequence, match="'nope'"):
        r.cache.reserve("nope", 1)
    with pytest.raises(ValueError, match="not allocated"):
        r.cache.swap_out([99])
    r.cache.add_sequence("a")
    with pytest.raises(ValueError, match="already"):
        r.cache.add_sequence("a")


def test_header_describes_the_tiers(make_cache):
    h = make_cache().cache.header()
    assert h.block_size == 4 and h.num_layers == 2
    assert [(t.name, t.capacity_blocks, t.codec) for t in h.tiers] == [
        ("device", 4, "fp32"), ("host", 4, "fp32"), ("disk", 8, "fp32")]


def test_header_names_each_tiers_codec(make_cache):
    from engine_support import tiny_config

    mixed = PagedKVCache(tiny_config(codec={"device": "mixed", "host": "fp16"}, mixed_low="bf16"))
    try:
        assert [(t.name, t.codec) for t in mixed.header().tiers] == [
            ("device", "mixed"), ("host", "fp16"), ("disk", "fp16")]
        assert mixed.header().calibration is None  # nothing calibrated
    finally:
        mixed.close()


def test_header_names_the_calibration_an_int8_cache_used():
    import torch

    from engine_support import tiny_config
    from kvdoctor.engine.kv.codecs import Calibration

    cal = Calibration(torch.ones(2, 2, 8), 4, 64, "four windows of test text")
    with PagedKVCache(tiny_config(codec="int8", calibration=cal)) as cache:
        assert cache.header().calibration == f"four windows of test text (digest {cal.digest})"


def test_trace_env_records_a_readable_trace(tmp_path, monkeypatch):
    from kvdoctor.trace import TraceReader

    from engine_support import tiny_config

    path = tmp_path / "run.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    cache = PagedKVCache(tiny_config(disk_dir=str(tmp_path)))
    cache.add_sequence("s", 1)
    slots = cache.reserve("s", 1)
    for layer in range(2):
        cache.store(layer, slots, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    cache.commit("s")
    cache.end_step(1)
    cache.remove_sequence("s")
    cache.close()
    reader = TraceReader(path)
    kinds = [type(e).__struct_config__.tag for e in reader]
    assert reader.header.block_size == 4 and not reader.truncated
    assert kinds[:3] == ["seq_start", "alloc", "write"] and kinds[-1] == "trace_end"
    assert "seq_end" in kinds and "free" in kinds


def test_close_removes_spill_dir(make_cache):
    r = make_cache()
    for i in range(5):
        r.add(i, 8)
        r.cache.end_step()
    d = r.cache.arenas["disk"].dir
    assert os.listdir(d)
    r.cache.close()
    assert not os.path.exists(d)
    r.cache.close()  # idempotent


def test_stats_count_tokens_and_fragmentation_of_partial_blocks(make_cache):
    r = make_cache()
    r.add("a", 6)  # 2 blocks, 2 empty slots
    r.fork("a", "b")  # shared: counted once
    r.add("c", 4)
    st = r.cache.stats()
    assert (st["blocks"], st["tokens"]) == (3, 10)
    assert st["fragmentation"] == pytest.approx(2 / 12)
    r.rollback("a", 3)  # a now uses 3 slots of block 0; b still holds all 6 tokens
    assert r.cache.stats()["tokens"] == 10
    r.cache.remove_sequence("b")
    assert r.cache.stats()["tokens"] == 7


def test_queries_answer_what_the_scheduler_and_features_ask(make_cache):
    # GIVEN a sequence of two blocks, one of them swapped out to the host
    r = make_cache()
    r.add("a", 6)
    first, last = r.cache.blocks_of("a")
    r.cache.swap_out([first.id], dst="host")
    # THEN the queries tell what the pool and the sequences table hold, without reaching into them
    assert r.cache.has_sequence("a") and not r.cache.has_sequence("z")
    assert r.cache.sequence("a").length == 6 and r.cache.blocks_of("a") == [first, last]
    assert r.cache.block(first.id) is first and r.cache.block(99) is None
    assert (r.cache.free_blocks("device"), r.cache.free_blocks("host")) == (3, 3)
    assert r.cache.settle(first)  # nothing in flight: nothing to land
    with pytest.raises(UnknownSequence):
        r.cache.blocks_of("z")


def test_ownerless_blocks_are_those_no_live_sequence_holds(make_cache):
    # GIVEN a cache whose leak-swapped fault forgets a finished sequence's swapped-out block
    r = make_cache(fault="leak-swapped")
    r.add("a", 8)
    r.add("b", 4)
    away = r.cache.block_table("a")[0]
    r.cache.swap_out([away], dst="host")
    # WHEN a finishes
    r.cache.remove_sequence("a")
    # THEN its forgotten block is the one no live sequence owns
    assert r.cache.ownerless_blocks() == {away}


def test_preallocate_grows_every_arena_to_its_capacity_and_keeps_the_slots_free(make_cache):
    # GIVEN a fresh cache WHEN it preallocates
    r = make_cache()
    r.cache.preallocate()
    # THEN every tier's arena holds its capacity, all of it free, and blocks still land there
    for tier, arena in r.cache.arenas.items():
        assert arena.num_slots == r.cache.config.capacity(tier)
        assert r.cache.free_blocks(tier) == r.cache.config.capacity(tier)
    r.add("a", 6)
    r.assert_intact("a")
    r.cache.pool.check()
