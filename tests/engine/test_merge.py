"""Token merging (issue 13 part 3): adjacent tokens with nearly the same key share one slot with a count.

The merge of one row is plain tensors in, tensors out: identical keys merge into one slot whose log(count)
bias makes attention exactly what it was; the cache merges a block in place (same id, slot and version,
a ``merge`` event, digests taken again); and on a tiny random Llama a run with merging on is clean under
every check.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.model.attention import AttnLayout, attend
from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.features.merging import TokenMerging
from kvdoctor.engine.features.protocol import Step
from kvdoctor.engine.kv.merge import DEAD_BIAS, SlotCounts, key_bias, merge_rows
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.features.sparse import BlockSparse

from engine_support import findings_of

PROMPT = torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One decode query (H, D) over keys (H_kv, T, D), with a key bias (H_kv, T)."""
    layout = AttnLayout.build([1], [k.shape[1]], sink_tokens=1)
    out, _ = attend(q[None, :, None], k[None], v[None], layout, scale=1 / math.sqrt(q.shape[-1]),
                    key_bias=bias[None] if bias is not None else None)
    return out[0, :, 0]  # (H, D)


def test_identical_keys_merge_into_one_slot_and_attention_is_unchanged():
    # GIVEN a row of 8 tokens whose keys 2..5 are identical (values all different)
    g = torch.Generator().manual_seed(0)
    H_kv, bs, D = 2, 8, 16
    k = torch.randn(H_kv, bs, D, generator=g)
    k[:, 2:6] = k[:, 2:3]
    v = torch.randn(H_kv, bs, D, generator=g)
    # WHEN the row is merged at a threshold only identical keys reach
    mk, mv, n = merge_rows(k, v, torch.ones(H_kv, bs, dtype=torch.int32), 0.9999)
    # THEN the four identical keys are one slot of count 4 holding their mean value, the rest stay, dead slots last
    assert n.tolist() == [[1, 1, 4, 1, 1, 0, 0, 0]] * H_kv
    assert torch.allclose(mk[:, 2], k[:, 2]) and torch.allclose(mv[:, 2], v[:, 2:6].mean(dim=1))
    assert torch.equal(mk[:, 3:5], k[:, 6:8]) and not mk[:, 5:].any() and not mv[:, 5:].any()
    # AND attention with log(count) added (dead slots hidden) is the attention over the 8 tokens, exactly
    q = torch.randn(4, D, generator=g)
    bias = key_bias([[SlotCounts(n[None])]], num_layers=1, num_kv_heads=H_kv, block_size=bs, width=1, device="cpu")
    assert torch.allclose(_attend_one(q, mk, mv, bias[0, 0]), _attend_one(q, k, v, None), atol=1e-6)


def test_log_count_is_what_keeps_a_merged_token_its_weight():
    # GIVEN one key seen 5 times next to 3 others, merged into one slot of count 5
    g = torch.Generator().manual_seed(1)
    D = 8
    k = torch.randn(1, 4, D, generator=g)
    v = torch.randn(1, 4, D, generator=g)
    full_k = torch.cat([k[:, :1].expand(1, 5, D), k[:, 1:]], dim=1)  # (1, 8, D): the 5 copies, then the rest
    full_v = torch.cat([v[:, :1].expand(1, 5, D), v[:, 1:]], dim=1)
    q = torch.randn(2, D, generator=g) * 3
    counts = torch.tensor([[[5, 1, 1, 1]]])
    bias = key_bias([[SlotCounts(counts)]], num_layers=1, num_kv_heads=1, block_size=4, width=1, device="cpu")
    # THEN the merged slot with +log(5) attends exactly as the 5 copies did; without the bias it does not
    want = _attend_one(q, full_k, full_v, None)
    assert torch.allclose(_attend_one(q, k, v, bias[0, 0]), want, atol=1e-6)
    assert not torch.allclose(_attend_one(q, k, v, None), want, atol=1e-3)
    assert bias[0, 0, 0].tolist() == pytest.approx([math.log(5), 0, 0, 0])


def test_dead_slots_get_a_finite_bias_that_hides_them():
    bias = key_bias([[SlotCounts(torch.tensor([[[2, 0]]]))], [None]], num_layers=1, num_kv_heads=1, block_size=2,
                    width=1, device="cpu")
    assert bias.shape == (1, 2, 1, 2)
    assert bias[0, 0, 0].tolist() == pytest.approx([math.log(2), DEAD_BIAS]) and not bias[0, 1].any()
    assert key_bias([[None, SlotCounts(None)]], num_layers=1, num_kv_heads=1, block_size=2, width=2,
                    device="cpu") is None  # nothing shrank: no bias, attention takes its usual path


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.sampled_from([4, 8, 16]), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_merging_keeps_every_token_and_the_weighted_sums(rows, bs, threshold, seed):
    # GIVEN rows of random keys where some neighbours are copies (so some merges happen at any threshold)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, bs, 4, generator=g)
    dup = torch.rand(rows, bs, generator=g) < 0.4
    for j in range(1, bs):
        k[:, j] = torch.where(dup[:, j, None], k[:, j - 1], k[:, j])
    v = torch.randn(rows, bs, 4, generator=g)
    # WHEN they are merged
    mk, mv, n = merge_rows(k, v, torch.ones(rows, bs, dtype=torch.int32), threshold)
    # THEN every token is in exactly one slot, live slots come first, and count-weighted K and V sums are kept
    assert n.sum(dim=1).tolist() == [bs] * rows and bool((n >= 0).all())
    live = n > 0
    assert torch.equal(live, live.cummin(dim=1).values)  # no live slot after a dead one
    assert torch.allclose((mk * n[..., None]).sum(1), k.sum(1), atol=1e-4)
    assert torch.allclose((mv * n[..., None]).sum(1), v.sum(1), atol=1e-4)
    # AND copies of the previous key always merge (cosine 1), so no row keeps more slots than distinct runs
    runs = 1 + (~dup[:, 1:]).sum(dim=1)
    assert bool((live.sum(dim=1) <= runs).all())


def _write_block(cache, seq: str, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Append tokens with given K and V (N, H_kv, D) in every layer."""
    slots = cache.reserve(seq, keys.shape[0])
    for layer in range(cache.config.num_layers):
        cache.store(layer, slots, keys, values)
    cache.commit(seq)


def test_the_cache_merges_a_block_in_place_with_an_event_and_keeps_it_through_swaps(make_cache):
    # GIVEN a sequence of 3 blocks of 4 tokens whose second block holds one key 4 times
    r = make_cache(device_blocks=8, verify="full")
    c = r.cache
    c.add_sequence("a", prompt_len=12)
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(12, 2, 8, generator=g)
    keys[4:8] = keys[4]
    values = torch.randn(12, 2, 8, generator=g)
    _write_block(c, "a", keys, values)
    b = c.seqs["a"].blocks[1]
    slot, version = b.slot, b.version
    # WHEN that block is merged
    freed = c.merge_tokens([b.id], 0.999)
    # THEN it shrank in place to 1 live slot per (layer, head): same id, slot and version, 6 rows of 8 given up
    assert freed == {b.id: 2 * 2 * 3}
    assert (b.slot, b.version, c.block_table("a")[1]) == (slot, version, b.id)
    assert c.merged[b.id].counts.tolist() == [[[4, 0, 0, 0]] * 2] * 2 and c.merged[b.id].live == 4
    (ev,) = r.kinds("merge")
    assert (ev.block, ev.tier, ev.version, ev.tokens, ev.heads, ev.layers, ev.slots) == (
        b.id, "device", version, 4, 2, [0, 1], [2, 2])
    assert ev.digest is not None and ev.new_digest is not None and ev.digest_layer is None
    # AND the stored slot holds the merged token; a swap out and back keeps bytes and counts
    k0 = c.read_blocks(0, torch.tensor([slot]))[0][0]  # (H, bs, D)
    assert torch.allclose(k0[:, 0], keys[4]) and not k0[:, 1:].any()
    c.swap_out([b.id], "host")
    c.swap_in([b.id])
    assert torch.equal(c.read_blocks(0, torch.tensor([b.slot]))[0][0], k0) and c.merged[b.id].counts[0, 0, 0] == 4
    c.pool.check()
    # AND a block that nothing merges is marked looked-at, with no event; a shared block is refused
    other = c.seqs["a"].blocks[0]
    assert c.merge_tokens([other.id], 0.999) == {} and c.merged[other.id].counts is None
    c.fork("a", "b")
    with pytest.raises(ValueError, match="one owner"):
        c.merge_tokens([c.seqs["a"].blocks[2].id], 0.5)
    assert len(r.kinds("merge")) == 1


def test_a_rollback_into_a_merged_block_is_refused(make_cache):
    r = make_cache(device_blocks=8)
    c = r.cache
    c.add_sequence("a", prompt_len=8)
    _write_block(c, "a", torch.ones(8, 2, 8), torch.randn(8, 2, 8))
    c.merge_tokens([c.seqs["a"].blocks[0].id], 0.99)
    with pytest.raises(ValueError, match="merged tokens"):
        c.rollback("a", 6)
    c.rollback("a", 4)  # back to the merged block's end: its tokens all stay


def test_config_takes_a_threshold_and_refuses_what_merging_cannot_weigh_yet():
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8)
    assert EngineConfig(**base, merge=0.9).merge == 0.9 and EngineConfig(**base, merge=0.9, topk=2).topk == 2
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="merge"):
            EngineConfig(**base, merge=bad)
    with pytest.raises(ValueError, match="staging_blocks"):
        EngineConfig(**base, merge=0.9, staging_blocks=2, device_blocks=8)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2).model


def test_a_run_with_merging_shrinks_old_blocks_only_and_every_check_is_clean(model, tmp_path, monkeypatch):
    # GIVEN a tiny random Llama whose trace is written, merging at a threshold its keys reach
    path = tmp_path / "merge.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    runner = Runner.create(model, block_size=8, device_blocks=64, host_blocks=0, merge=0.3, stats_every=1,
                           local_blocks=2, verify="full")
    # WHEN it generates
    (gen,) = runner.generate([PROMPT], max_new_tokens=16)
    merging = runner.feature(TokenMerging)
    runner.close()
    monkeypatch.delenv("KVDOCTOR_TRACE")
    _, events, findings = findings_of(path)
    # THEN blocks merged, each a merge event naming a block past the sink, shrunk in some layer
    merges = [e for e in events if type(e).__name__ == "Merge"]
    assert len(gen.token_ids) == 16 and merges and len(merges) == merging.blocks_merged
    writes = {}
    for e in events:
        if type(e).__name__ == "Write":
            writes.setdefault(e.block, []).append(e)
    for m in merges:
        first = writes[m.block][0]
        assert first.pos >= 8  # never the sink block (positions 0..7)
        assert sum(w.n for w in writes[m.block]) == 8  # only full blocks
        assert all(s < m.tokens * m.heads for s in m.slots) and m.layers
    # AND the run is clean under every check (stale, integrity, leak, batch, attention ...)
    assert findings == []



def test_block_sparse_decode_and_masked_paths_weigh_merged_slots_alike(make_cache):
    # GIVEN 40 tokens in 10 blocks of 4, blocks 1..7 merged, their summaries, and a decode query
    r = make_cache(device_blocks=32)
    r.add("a", 40)
    c = r.cache
    assert c.merge_tokens(c.block_table("a")[1:8], 0.2)
    sp = BlockSparse(c, k=2, sink_blocks=1, local_blocks=2)
    plan = c.plan_reads(["a"], [1])  # the step's read plan: its block table and the merged slots' bias
    sp.begin_step(Step(["a"], c, plan))
    for layer in range(2):
        sp.after_store(layer, ["a"])
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(3))
    table = plan.table([0]).slots
    bias = plan.key_bias([0], 10)[1]
    # WHEN the decode path reads only the chosen blocks, and the masked path masks full attention to them
    out, _ = sp._decode(1, q, ["a"], table, [40], [10], 0.3, False, bias)
    fused, _, _ = sp._masked(1, q, ["a"], table, [40], [10], 0.3, False, False, bias)
    explicit, mass, _ = sp._masked(1, q, ["a"], table, [40], [10], 0.3, True, False, bias)
    # THEN all three add the same log(count)s and hide the same dead slots; without them the output differs
    torch.testing.assert_close(out, fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, explicit, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, sp._decode(1, q, ["a"], table, [40], [10], 0.3)[0], atol=1e-4)


def test_block_sparse_reads_weigh_merged_slots_as_dense_reads_do(model):
    # GIVEN dense and top-k runs merging alike, top-k reading every page (so it must equal dense)
    def run(**config):
        runner = Runner.create(model, block_size=8, device_blocks=64, host_blocks=0, merge=0.3, stats_every=0,
                               **config)
        runner.cache.add_sequence("a", prompt_len=len(PROMPT))
        logits = [runner.forward([("a", PROMPT[:96])], all_logits=True)]
        runner.cache.end_step()
        for t in PROMPT[96:100]:  # decode steps over merged blocks
            logits.append(runner.forward([("a", [t])]))
            runner.cache.end_step()
        merged = runner.feature(TokenMerging).blocks_merged
        runner.close()
        return torch.cat(logits), merged

    dense, merged = run()
    sparse, merged_sparse = run(topk=64)
    # THEN both merged the same blocks, and top-k reading every page gives dense's logits
    assert merged == merged_sparse > 0
    assert torch.allclose(sparse, dense, atol=1e-4)
    # AND a top-k that leaves pages out merges as much and stays finite (its chunk and decode paths with the bias)
    few, merged_few = run(topk=2)
    assert merged_few == merged and torch.isfinite(few).all()
