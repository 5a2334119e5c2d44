"""Block-sparse top-k attention: Quest bounds, selection, exactness when k covers every block, reads of only what is chosen."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.model.attention import AttnLayout
from kvdoctor.engine.features.protocol import Step
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.events import attn_rows
from kvdoctor.engine.features.sparse import BlockSparse, block_upper_bound, chunk_block_mask, select_blocks

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


def _summarised(make_cache, n: int, seed: int, **kw) -> tuple[Recorder, BlockSparse, torch.Tensor, torch.Tensor]:
    """``n`` cached tokens in blocks of 4, their summaries, a decode query (4 query heads on 2 KV heads), the table."""
    r = _filled(make_cache, n)
    sp = BlockSparse(r.cache, **kw)
    plan = r.cache.plan_reads(["a"], [1])
    sp.begin_step(Step(["a"], r.cache, plan))
    for layer in range(2):
        sp.after_store(layer, ["a"])
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(seed))
    return r, sp, q, plan.table([0]).slots


def test_decode_reads_only_chosen_rows_and_matches_masked_attention(make_cache):
    # GIVEN 40 cached tokens in 10 blocks and a decode query (4 query heads on 2 KV heads)
    r, sp, q, table = _summarised(make_cache, 40, 1, k=2, sink_blocks=1, local_blocks=2)
    # WHEN attention gathers only the chosen blocks per KV head
    out, _ = sp._decode(1, q, ["a"], table, [40], [10], 0.3)
    # THEN exactly sink + k + window rows were read ...
    assert sp.read.rows_read == 2 * (1 + 2 + 2)
    # ... and the output is that of full attention masked to the same blocks
    ref, _, _ = sp._masked(1, q, ["a"], table, [40], [10], 0.3, False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_pages_of_several_blocks_are_chosen_whole_with_the_sink_page_and_the_window(make_cache):
    # GIVEN 40 cached tokens in 10 blocks of 4, selected in pages of 2 blocks (5 pages)
    r, sp, q, table = _summarised(make_cache, 40, 2, k=1, sink_blocks=1, local_blocks=1, blocks_per_page=2)
    # WHEN a decode query takes the top page
    out, (scores, _) = sp._decode(1, q, ["a"], table, [40], [10], 0.3, want_scores=True)
    # THEN every KV head read the sink page, the newest page and one more: 3 pages of 2 blocks
    assert sp.read.rows_read == 2 * 3 * 2
    read = sorted(sp.read.blocks["a"])
    assert {0, 1, 8, 9} <= set(read) and all({b - b % 2, b - b % 2 + 1} <= set(read) for b in read)
    # ... the output is masked attention over the same pages, and the scores it hands back are
    # the keys' real scores where read and carry no probability elsewhere
    ref, _, (ref_scores, _) = sp._masked(1, q, ["a"], table, [40], [10], 0.3, False, True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.softmax(scores, -1), torch.softmax(ref_scores, -1), atol=1e-6, rtol=1e-5)
    assert torch.isfinite(scores).all() and (torch.softmax(scores, -1)[..., 8:32].sum(-1) < 1).all()


def test_a_page_that_is_partly_filled_reads_only_its_blocks(make_cache):
    # GIVEN 21 tokens: 6 blocks of 4 (the last holds one token), pages of 4 blocks (the last page has 2)
    r, sp, q, table = _summarised(make_cache, 21, 3, k=0, sink_blocks=1, local_blocks=1, blocks_per_page=4)
    # WHEN a decode query reads (both pages are fixed: sink and window)
    out, _ = sp._decode(0, q, ["a"], table, [21], [6], 0.3)
    # THEN it read the 6 blocks that exist, never one past the end
    assert sorted(sp.read.blocks["a"]) == list(range(6)) and sp.read.rows_read == 2 * 6
    assert torch.isfinite(out).all()


def test_chunk_pages_keep_each_querys_window_and_sink_page():
    # 6 pages of 2 blocks of 4 tokens; sink_blocks=1 -> page 0; local_blocks=3 -> the pages of the 3 newest blocks
    score = torch.tensor([[0.0, -1.0, -5.0, -0.5, -2.0, -9.0]])
    q_pos = torch.tensor([10, 45])  # blocks 2 and 11: pages 1 and 5
    mask = chunk_block_mask(score[:, None].expand(1, 2, 6), q_pos, 4, 1, 1, 3, blocks_per_page=2)
    # query at token 10 (block 2): blocks 0..2 are its window -> pages 0, 1; nothing between
    # query at token 45 (block 11): blocks 9..11 -> pages 4, 5; sink page 0; top-1 of pages 1..3 is page 3
    assert mask[0].int().tolist() == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 1, 1]]


@pytest.fixture(autouse=True)
def _dense_by_torch(monkeypatch):
    """Dense decode by the runner's torch path, whose every operation block-sparse reads share, so "equal to
    dense" can be exact (the compiled decode layers sum in another order: equal to the last bits only)."""
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "0")


@pytest.fixture(scope="module")
def model():
    from kvdoctor.engine.model.model import tiny_llama

    return tiny_llama().model


def _run(model, stats_every: int = 0, **config) -> tuple[list[torch.Tensor], Runner, list]:
    runner = Runner.create(model, stats_every=stats_every, block_size=4, device_blocks=64, host_blocks=0, **config)
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


def test_dense_prefill_and_dense_layers_read_every_block_there(model):
    # GIVEN top-1 attention that prefills densely, and top-1 attention with every layer dense
    dense, r1, _ = _run(model)
    prefill, r2, _ = _run(model, topk=1, dense_prefill=True)
    layers, r3, _ = _run(model, topk=1, dense_layers=model.config.num_hidden_layers)
    # THEN the prompt's logits are the dense ones exactly while decoding reads only the picks; every layer dense is dense
    assert torch.equal(prefill[0], dense[0]) and not torch.allclose(prefill[-1], dense[-1])
    assert all(torch.equal(a, b) for a, b in zip(dense, layers))
    for r in (r1, r2, r3):
        r.close()


def test_topk_covering_every_page_equals_dense_exactly(model):
    # GIVEN cache blocks of 4 tokens and pages of 16 (4 blocks), k covering all 3 pages
    dense, r1, _ = _run(model)
    sparse, r2, _ = _run(model, topk=3, sparse_block_size=16)
    assert r2.feature(BlockSparse).blocks_per_page == 4
    assert all(torch.equal(a, b) for a, b in zip(dense, sparse))
    r1.close()
    r2.close()


def test_pages_read_whole_and_read_events_list_cache_blocks(model):
    # GIVEN pages of 2 cache blocks and k=1 page
    logits, runner, events = _run(model, topk=1, sparse_block_size=8, sink_blocks=1, local_blocks=1)
    # THEN a decode step over 11 blocks (6 pages) read sink page + top page + newest page: <= 6 blocks per head
    # (the newest page holds the 11th block only)
    read = runner.feature(BlockSparse).read
    assert read.rows_read == 2 * 2 * 5 and read.rows_dense == 2 * 2 * 11
    reads = [e for e in events if type(e).__struct_config__.tag == "read"]
    table = runner.cache.block_table("s")
    last = set(reads[-1].blocks)
    assert {table[0], table[1], table[10]} <= last and last < set(table)
    runner.close()


def _attn(events) -> list:
    return attn_rows(events)


def test_sparse_path_emits_attn_events_from_what_it_read(model):
    # GIVEN statistics every step, dense and with k covering everything
    _, r1, dense = _run(model, 1)
    _, r2, full = _run(model, 1, topk=64)
    _, r3, sparse = _run(model, 1, topk=1)
    # THEN every path emits one attn event per layer and step, the same when k covers every block
    assert len(_attn(full)) == len(_attn(dense)) == len(_attn(sparse)) == 5 * 2
    for a, b in zip(_attn(dense), _attn(full)):
        assert (a.layer, a.entropy, a.sink, a.max_logit) == (b.layer, b.entropy, b.sink, b.max_logit)
    # AND top-1's statistics are over the keys it read: finite, with the (always read) sink block's mass
    for e in _attn(sparse):
        assert e.nonfinite == 0 and 0 < e.sink <= 1 and e.entropy >= 0
    decode_dense = [e.entropy for e in _attn(dense)[2:]]
    decode_sparse = [e.entropy for e in _attn(sparse)[2:]]
    assert sum(decode_sparse) < sum(decode_dense)  # 3 of 11 blocks: a narrower distribution
    for r in (r1, r2, r3):
        r.close()


def test_sparse_block_size_is_a_multiple_of_the_block_size():
    from kvdoctor.engine.config import EngineConfig

    assert EngineConfig(2, 2, 8, block_size=16).sparse_block_size == 16
    assert EngineConfig(2, 2, 8, block_size=16, sparse_block_size=64).sparse_block_size == 64
    with pytest.raises(ValueError, match="sparse_block_size"):
        EngineConfig(2, 2, 8, block_size=16, sparse_block_size=40)


def test_small_topk_reads_fewer_blocks_and_says_so_in_read_events(model):
    dense, r1, _ = _run(model)
    logits, runner, events = _run(model, topk=1, sink_blocks=1, local_blocks=1)
    # THEN a decode step read (layers x KV heads x 3 blocks) of the 10 blocks' rows ...
    read = runner.feature(BlockSparse).read
    assert read.rows_read == 2 * 2 * 3 and read.rows_dense == 2 * 2 * 11
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


def test_h2o_keeps_every_row_of_a_batch_within_the_budget(model):
    # GIVEN H2O over rows of different lengths decoded together (their attention masked per row, for the mass)
    from kvdoctor.engine.serving.scheduler import Request, Scheduler

    runner = Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, importance="h2o",
                           kv_budget_blocks=4, sink_blocks=1, local_blocks=1)
    events: list = []
    runner.bus.subscribe(events.extend)
    sched = Scheduler(runner, max_batch=4)
    seqs = [sched.submit(Request([(i * 13) % 120 + 3 for i in range(n)], max_new_tokens=8, ignore_eos=True))
            for n in (9, 21, 37)]
    # WHEN they run to the end, each step checking what every row holds
    held = []
    while sched.has_work():
        sched.step()
        held += [len(runner.cache.block_table(s)) for s in seqs if runner.cache.has_sequence(s)]
    runner.close()
    # THEN every row finished, none held more than the budget after a step, and blocks were evicted as H2O
    assert all(len(sched.done[s].token_ids) == 8 for s in seqs) and max(held) <= 4
    assert {e.reason for e in events if type(e).__struct_config__.tag == "evict"} == {"h2o"}


def test_layout_unused_when_k_covers_all(make_cache):
    r = _filled(make_cache, 9)
    sp = BlockSparse(r.cache, k=8)
    assert sp.covers_all(3) and not BlockSparse(r.cache, k=0).covers_all(3)
    assert AttnLayout.build([1], [9], sink_tokens=4).allowed is None
