"""A step's ``ReadPlan``: the block tables, row offsets and K/V attention reads through it are the cache's own."""

from __future__ import annotations

import pytest
import torch

ROWS = (("a", 5), ("b", 12), ("c", 9))


@pytest.mark.parametrize("codec", ["fp32", "nf4"])
def test_a_plan_reads_each_row_as_the_cache_gathers_it(make_cache, codec):
    # GIVEN three sequences of different lengths in one cache, stored raw (fp32) or as codes (nf4)
    r = make_cache(device_blocks=16, codec=codec)
    for seq, n in ROWS:
        r.add(seq, n)
    # WHEN the step's plan builds the table of rows b and c and gathers every layer through it
    plan = r.cache.plan_reads([seq for seq, _ in ROWS], [1] * len(ROWS))
    t = plan.table([1, 2])
    # THEN the table is padded to the longer row, with row offsets where the arena holds the dtype as it is
    assert t.slots.shape == (2, 3) and (t.kv_rows is not None) == (codec == "fp32")
    assert (plan.layer_kv is not None) == (codec == "fp32")
    # AND each row's keys and values are what the cache gathers for it, layer by layer
    for layer in range(r.cache.config.num_layers):
        k, v = plan.gather(layer, t, 12, torch.float32)  # (2, H_kv, 12, D) each
        for i, (seq, n) in enumerate(ROWS[1:]):
            gk, gv = r.cache.gather(seq, layer)  # (H_kv, n, D) each
            assert torch.equal(k[i, :, :n], gk) and torch.equal(v[i, :, :n], gv)
    # AND it names each row's blocks, with no score bias while nothing is merged
    assert [plan.block_ids(i) for i in range(3)] == [r.cache.block_table(seq) for seq, _ in ROWS]
    assert plan.key_bias([0, 1, 2], 3) is None


def test_a_plan_carries_the_bias_of_merged_blocks_to_the_rows_that_read_them(make_cache):
    # GIVEN two sequences, one with an old block merged (tokens whose keys point alike share a slot)
    r = make_cache(device_blocks=16)
    r.add("a", 12)
    r.add("b", 8)
    c = r.cache
    merged = c.block_table("a")[1]
    assert c.merge_tokens([merged], 0.0)
    # WHEN the plan of both rows gives their score bias
    plan = c.plan_reads(["a", "b"], [1, 1])
    bias = plan.key_bias([0, 1], 3)  # (L, B, H_kv, 3 blocks * 4 slots)
    # THEN the merged block's slots carry its log(count)s and dead-slot bias, and no other key has any
    assert bias.shape == (2, 2, 2, 12)
    assert torch.equal(bias[:, 0, :, 4:8], c.merged[merged].bias)
    assert not bias[:, 1].any() and not bias[:, 0, :, :4].any() and not bias[:, 0, :, 8:].any()
