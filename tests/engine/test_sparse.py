"""Block-sparse top-k attention: Quest bounds, selection, exactness when k covers every block, reads of only what is chosen."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.attention import AttnLayout
from kvdoctor.engine.runner import Runner
from kvdoctor.engine.sparse import BlockSparse, block_upper_bound, chunk_block_mask, select_blocks

from engine_support import Recorder


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 10_000), nb=st.integers(1, 6), g=st.integers(1, 3))
def test_block_bound_is_never_below_any_score_in_the_block(seed, nb, g):
    # GIVEN random keys in nb blocks of 8 and a query per head
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, nb, 8, 16, generator=gen) * 3  # (H_kv, nb, bs, D)
    q = torch.randn(2, g, 1, 16, generator=gen)
    # WHEN each block is bounded from its per-channel min and max
    bound = block_upper_bound(q, keys.amin(dim=2), keys.amax(dim=2))  # (H_kv, g, 1, nb)
    # THEN no key of the block scores higher than its bound
    scores = torch.einsum("hgsd,hbtd->hgsbt", q, keys).amax(dim=-1)  # (H_kv, g, 1, nb)
    assert (scores <= bound + 1e-4).all()


def test_selection_keeps_sinks_and_window_and_takes_the_top_k_between():
    score = torch.tensor([[0.0, -1.0, -5.0, -0.5, -2.0, -9.0, -9.0]])  # one KV head, 7 blocks
    assert select_blocks(score, 7, 2, 1, 2).tolist() == [[0, 1, 3, 5, 6]]
    assert select_blocks(score, 7, 10, 1, 2).tolist() == [list(range(7))]
    assert select_blocks(score, 2, 3, 1, 2).tolist() == [[0, 1]]
    # a chunk: each query gets its own window and chooses among the blocks before it
    mask = chunk_block_mask(score[:, None].expand(1, 2, 7), torch.tensor([9, 27]), 4, 1, 1, 1)
    assert mask[0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 1]]


def _filled(make_cache, n: int, **kw) -> Recorder:
    r = make_cache(device_blocks=32, **kw)
    r.add("a", n)
    return r


def test_decode_reads_only_chosen_rows_and_matches_masked_attention(make_cache):
    # GIVEN 40 cached tokens in 10 blocks and a decode query (4 query heads on 2 KV heads)
    r = _filled(make_cache, 40)
    sp = BlockSparse(r.cache, k=2, sink_blocks=1, local_blocks=2)
    sp.begin_step(["a"])
    for layer in range(2):
        sp.after_store(layer, ["a"])
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(1))
    table = r.cache.slot_table("a")[None]
    # WHEN attention gathers only the chosen blocks per KV head
    out = sp._decode(1, q, ["a"], table, [40], [10], 0.3)
    # THEN exactly sink + k + window rows were read ...
    assert sp.read.rows_read == 2 * (1 + 2 + 2)
    # ... and the output is that of full attention masked to the same blocks
    ref, _ = sp._masked(1, q, ["a"], table, [40], [10], 0.3, False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    from kvdoctor.engine.model import tiny_llama

    return tiny_llama().model


def _run(model, **config) -> tuple[list[torch.Tensor], Runner, list]:
    runner = Runner.create(model, stats_every=0, block_size=4, device_blocks=64, host_blocks=0, **config)
    events: list = []
    runner.bus.subscribe(events.extend)
    runner.cache.add_sequence("s", prompt_len=37)
    ids = [(i * 13) % 120 + 3 for i in range(37)]
    logits = [runner.forward([("s", ids)], all_logits=True)]
    tok = int(logits[-1][-1].argmax())
    for _ in range(4):
        logits.append(runner.forward([("s", [tok])]))
        tok = int(logits[-1][-1].argmax())
        runner.cache.end_step()
    runner.bus.flush()
    return logits, runner, events


def test_topk_covering_every_block_equals_dense_exactly(model):
    dense, r1, _ = _run(model)
    sparse, r2, _ = _run(model, topk=64)
    assert all(torch.equal(a, b) for a, b in zip(dense, sparse))
    r1.close()
    r2.close()


def test_small_topk_reads_fewer_blocks_and_says_so_in_read_events(model):
    dense, r1, _ = _run(model)
    logits, runner, events = _run(model, topk=1, sink_blocks=1, local_blocks=1)
    # THEN a decode step read (layers x KV heads x 3 blocks) of the 10 blocks' rows ...
    assert runner._sparse.read.rows_read == 2 * 2 * 3 and runner._sparse.read.rows_dense == 2 * 2 * 11
    # ... its read events list the blocks some head read, a subset of the table, never all of it
    reads = [e for e in events if type(e).__struct_config__.tag == "read"]
    table = runner.cache.block_table("s")
    assert all(set(e.blocks) <= set(table) for e in reads)
    assert len(reads[-1].blocks) < len(table) and table[0] in reads[-1].blocks and table[-1] in reads[-1].blocks
    # AND the prefill (each query choosing its own blocks) still predicts close to dense
    assert (logits[0] - dense[0]).abs().max() < 1.0
    runner.close()
    r1.close()


def test_h2o_eviction_in_the_runner_keeps_the_budget_and_emits_evict(model):
    _, runner, events = _run(model, importance="h2o", kv_budget_blocks=4, sink_blocks=1, local_blocks=1)
    evicts = [e for e in events if type(e).__struct_config__.tag == "evict"]
    assert evicts and {e.reason for e in evicts} == {"h2o"}
    assert len(runner.cache.block_table("s")) <= 4
    runner.close()


def test_layout_unused_when_k_covers_all(make_cache):
    r = _filled(make_cache, 9)
    sp = BlockSparse(r.cache, k=8)
    assert sp.covers_all(3) and not BlockSparse(r.cache, k=0).covers_all(3)
    assert AttnLayout.build([1], [9], sink_tokens=4).allowed is None
