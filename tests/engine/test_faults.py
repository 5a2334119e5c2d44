"""Each named fault makes the real engine misbehave, and the events it emits show it.

These tests check the engine side only (wrong memory written, wrong copy served,
blocks never freed); the checks that find these from the events are tested with
the checks.
"""

from __future__ import annotations

import pytest
import torch

from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.faults import FAULTS

from engine_support import tiny_config


def test_faults_are_off_by_default(make_cache):
    f = make_cache().cache.faults
    assert f.name is None and not (f.leak_swapped or f.stale_version or f.batch_misalign or f.attention_nan)


def test_env_var_switches_a_fault_on_and_rejects_unknown_names(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDOCTOR_FAULT", "leak-swapped")
    with PagedKVCache(tiny_config(disk_dir=str(tmp_path))) as cache:
        assert cache.faults.leak_swapped
    monkeypatch.setenv("KVDOCTOR_FAULT", "nope")
    with pytest.raises(ValueError, match="KVDOCTOR_FAULT='nope'"):
        PagedKVCache(tiny_config(disk_dir=str(tmp_path)))
    assert set(FAULTS) == {"leak-swapped", "stale-version", "stale-staging", "batch-misalign", "attention-nan",
                           "overwrite-foreign", "stale-slot", "wrong-scale", "bit-flip", "row-off-by-one",
                           "zeroed-block", "noise", "free-during-prefetch", "prefix-unsalted", "prefix-overwritten",
                           "prefix-freed-in-use", "spec-rollback-uncut", "nonfinite-write"}


def test_leak_swapped_keeps_swapped_blocks_allocated_after_seq_end(make_cache):
    # GIVEN a sequence with one block on device and one swapped out to host
    r = make_cache(fault="leak-swapped")
    r.add("a", 8)
    r.cache.end_step()
    away, home = r.cache.block_table("a")
    r.cache.swap_out([away], "host")
    # WHEN it ends
    r.cache.remove_sequence("a")
    r.cache.end_step()
    # THEN the device block is freed but the swapped one is never freed and still holds host memory
    assert [e.block for e in r.kinds("free")] == [home]
    assert away in r.cache.pool.blocks and r.cache.stats()["tiers"]["host"]["used_blocks"] == 1
    assert r.kinds("usage")[-2].tier == "host" and r.kinds("usage")[-2].used_blocks == 1


def test_stale_version_serves_an_old_copy_after_new_writes(make_cache):
    # GIVEN a sequence whose partly filled tail block went to host and came back
    r = make_cache(fault="stale-version")
    r.add("a", 6)
    tail = r.cache.block_table("a")[1]
    r.cache.end_step()
    r.cache.swap_out([tail], "host")
    r.cache.swap_in([tail])
    # WHEN it is written again, swapped out and in once more
    r.write("a", 1)
    r.cache.end_step()
    r.cache.swap_out([tail], "host")
    r.cache.swap_in([tail])
    # THEN the last swap-in brings back the copy from before the write, with its older version
    write_v = r.kinds("write")[-1].version
    assert write_v == 7
    assert r.kinds("swap_in")[-1].version == 6 < write_v
    # AND the bytes really are stale: the token written at position 6 is gone
    k, _ = r.cache.gather("a", 0)
    assert not torch.equal(k[:, 6], r.kv["a"][0][0][6])
    assert torch.equal(k[:, :6], r.kv["a"][0][0][:6].transpose(0, 1))


def test_batch_misalign_writes_a_row_into_another_sequences_block(make_cache):
    # GIVEN two decoding sequences in one batched step
    r = make_cache(fault="batch-misalign")
    r.add("a", 5)
    r.add("b", 2)
    r.cache.end_step()
    a_tail, b_tail = r.cache.block_table("a")[-1], r.cache.block_table("b")[-1]
    slots = torch.cat([r.cache.reserve("a", 1), r.cache.reserve("b", 1)])
    k = torch.stack([torch.full((2, 8), 1.0), torch.full((2, 8), 2.0)])
    for layer in range(2):
        r.cache.store(layer, slots, k, k)
    r.cache.commit("a")
    r.cache.commit("b")
    # THEN b's write event names a's block, which b does not own
    wb = [e for e in r.kinds("write") if e.seq == "b"][-1]
    assert wb.block == a_tail and wb.block not in r.cache.block_table("b")
    # AND b's K/V really landed in a's block (at b's offset 2), not in b's own block
    a_slot = r.cache.pool.blocks[a_tail].slot
    assert bool((r.cache.layer_kv(0)[a_slot, :, 0, 2] == 2.0).all())
    got_b, _ = r.cache.gather("b", 0)
    assert not bool((got_b[:, 2] == 2.0).all())
    assert b_tail in r.cache.block_table("b")


def test_attention_nan_hook_corrupts_one_layer_from_step_two(make_cache):
    r = make_cache(fault="attention-nan", num_layers=4)
    assert r.cache.score_hook(2) is None  # step 0: not yet
    r.cache.end_step()
    r.cache.end_step()
    assert r.cache.score_hook(1) is None  # only the middle layer
    hook = r.cache.score_hook(2)
    scores = torch.zeros(1, 3, 2, 5)  # (B, H, S, T)
    out = hook(scores)
    assert int(torch.isnan(out).sum()) == 1 and torch.isnan(out[0, 0, -1, -1])
    clean = make_cache(num_layers=4)
    clean.cache.end_step()
    clean.cache.end_step()
    assert clean.cache.score_hook(2) is None
