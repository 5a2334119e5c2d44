"""Attention over gathered K/V: GQA, padding and causal masks, statistics from the scores."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.model import attention
from kvdoctor.engine.model.attention import AttnLayout, Newest, attend, attention_stats, layer_stats

needs_kernel = pytest.mark.skipif(attention._stats_kernel() is None, reason="the statistics kernel does not build here")


def _reference(q, k, v, q_len, kv_len, scale):
    """Plain per-row attention with repeated K/V: the definition the engine must match."""
    H, H_kv = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // H_kv, dim=0)[:, :kv_len]
    v = v.repeat_interleave(H // H_kv, dim=0)[:, :kv_len]
    q = q[:, :q_len]
    scores = q @ k.transpose(-1, -2) * scale  # (H, S, T)
    pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > pos, float("-inf"))
    p = torch.softmax(scores, -1)
    return p @ v, scores[:, -1], p[:, -1]


def _batch(q_lens, kv_lens, H=4, H_kv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S, T = len(q_lens), max(q_lens), max(kv_lens)
    return (torch.randn(B, H, S, D, generator=g), torch.randn(B, H_kv, T, D, generator=g), torch.randn(B, H_kv, T, D, generator=g))


@settings(deadline=None, max_examples=40)
@given(rows=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 20)), min_size=1, max_size=4), stats=st.booleans())
def test_padded_batches_match_per_row_reference(rows, stats):
    # GIVEN rows with different numbers of new queries and of cached keys, padded into one batch
    q_lens = [q for q, _ in rows]
    kv_lens = [q + past for q, past in rows]
    q, k, v = _batch(q_lens, kv_lens)
    layout = AttnLayout.build(q_lens, kv_lens, sink_tokens=4)
    # WHEN attention runs on the padded batch (explicit or fused path)
    out, newest = attend(q, k, v, layout, scale=0.3, scores=stats)
    st_ = attention_stats(newest.scores[None], layout.keep, sink_tokens=4, per_head=True) if stats else None
    # THEN every row's valid queries match the per-row reference
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        ref, scores, probs = _reference(q[b], k[b], v[b], ql, kl, 0.3)
        torch.testing.assert_close(out[b, :, :ql], ref, atol=1e-5, rtol=1e-5)
        if stats:
            max_logit, entropy, sink, nonfinite = st_.summary[0, b].tolist()
            assert max_logit == pytest.approx(scores.max().item(), abs=1e-5)
            ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
            assert entropy == pytest.approx(ent.mean().item(), abs=1e-5)
            assert sink == pytest.approx(probs[:, :4].sum(-1).mean().item(), abs=1e-5)
            assert nonfinite == 0
            torch.testing.assert_close(st_.heads_entropy[0, b], ent, atol=1e-5, rtol=1e-5)
    if not stats:
        assert newest is None
    elif attention._stats_kernel() is not None:  # AND the compiled statistics agree (from the probabilities in decode)
        assert (newest.probs is not None) == (max(q_lens) == 1)
        fast = layer_stats([newest], layout.keep, sink_tokens=4, per_head=True)
        torch.testing.assert_close(fast.summary, st_.summary, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(fast.heads_entropy, st_.heads_entropy, atol=2e-5, rtol=2e-5)


@needs_kernel
@settings(deadline=None, max_examples=40)
@given(kv_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4), spread=st.floats(0.1, 30), seed=st.integers(0, 999))
def test_decode_statistics_from_the_probabilities_equal_those_from_the_scores(kv_lens, spread, seed):
    # GIVEN one new query per row over keys of different lengths (a padded decode batch), sharp or flat
    q, k, v = _batch([1] * len(kv_lens), kv_lens, seed=seed)
    layout = AttnLayout.build([1] * len(kv_lens), kv_lens, sink_tokens=4)
    # WHEN attention hands back its probabilities with the scores
    _, newest = attend(q * spread, k, v, layout, scale=0.3, scores=True)
    # THEN statistics taken from them equal torch's passes over the scores alone
    fast = layer_stats([newest, newest], layout.keep, sink_tokens=4, per_head=True)
    want = attention_stats(torch.stack([newest.scores] * 2), layout.keep, sink_tokens=4, per_head=True)
    torch.testing.assert_close(fast.summary, want.summary, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(fast.heads_entropy, want.heads_entropy, atol=3e-5, rtol=3e-5)


def test_uniform_attention_has_log_t_entropy_and_sink_share():
    # GIVEN keys that are all zero, so every score is equal
    q, k, v = _batch([1], [32])
    k.zero_()
    layout = AttnLayout.build([1], [32], sink_tokens=16)
    # WHEN the statistics are taken
    _, newest = attend(q, k, v, layout, scale=0.125, scores=True)
    max_logit, entropy, sink, nonfinite = attention_stats(newest.scores[None], layout.keep, sink_tokens=16).summary[0, 0].tolist()
    # THEN attention is uniform: entropy ln 32, half the mass on the first block, logits 0
    assert entropy == pytest.approx(math.log(32), abs=1e-5)
    assert sink == pytest.approx(0.5, abs=1e-6)
    assert max_logit == 0.0 and nonfinite == 0


def test_nan_in_keys_is_counted_as_nonfinite():
    # GIVEN one corrupted key
    q, k, v = _batch([1, 1], [5, 5])
    k[1, 0, 2, 0] = float("nan")
    layout = AttnLayout.build([1, 1], [5, 5], sink_tokens=16)
    # WHEN attention runs with statistics
    _, newest = attend(q, k, v, layout, scale=0.5, scores=True)
    summary = attention_stats(newest.scores[None], layout.keep, sink_tokens=16).summary[0]
    # THEN only the corrupted row reports non-finite values: the key's NaN score in both query heads
    # sharing its KV head, and the 5 probabilities of each head whose softmax it breaks; the other
    # statistics stay finite numbers
    assert summary[0, 3].item() == 0
    assert summary[1, 3].item() == 2 * (1 + 5)
    assert torch.isfinite(summary).all()


def test_fresh_prefill_uses_no_mask_and_is_causal():
    layout = AttnLayout.build([7], [7], sink_tokens=4)
    assert layout.allowed is None and layout.causal
    q, k, v = _batch([7], [7])
    fast, _ = attend(q, k, v, layout, scale=0.3)
    slow, _ = attend(q, k, v, layout, scale=0.3, scores=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_layout_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        AttnLayout.build([3], [2], sink_tokens=4)


def test_corrupt_hook_sees_scores_before_softmax_and_forces_the_explicit_path():
    q, k, v = _batch([1], [6])
    layout = AttnLayout.build([1], [6], sink_tokens=4)

    def poison(scores):
        scores[..., 0, -1, -1] = float("nan")
        return scores

    out, newest = attend(q, k, v, layout, scale=0.5, corrupt=poison)
    assert newest is None and torch.isnan(out[0, 0]).all() and not torch.isnan(out[0, 1:]).any()


def _stacked(scores, keep, **kw):
    return attention_stats(scores, keep, **kw)


def _per_layer(scores, keep, **kw):
    return layer_stats([Newest(s) for s in scores.unbind(0)], keep, **kw)


@pytest.mark.parametrize("stats", [_stacked, _per_layer], ids=["torch", "per-layer"])
@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), float("nan")])
def test_any_visible_nonfinite_score_is_counted_and_hidden_garbage_is_not(bad, stats):
    # GIVEN scores of two rows whose second row is shorter: keys past its length hold garbage
    L, B, H, T = 2, 2, 3, 6
    scores = torch.randn(L, B, H, T, generator=torch.Generator().manual_seed(3))
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    scores[:, 1, :, 4:] = float("nan")  # hidden: never seen by the query, never counted
    clean = stats(scores, keep, sink_tokens=2).summary
    # WHEN one visible score of layer 1, row 0, head 2 is not finite
    scores[1, 0, 2, 3] = bad
    summary = stats(scores, keep, sink_tokens=2).summary
    # THEN that row counts it (and, for NaN or +inf, the 6 probabilities of the head it breaks), the
    # hidden NaNs count nothing, and every other statistic stays a finite number
    assert summary[1, 0, 3].item() == (1 if bad == float("-inf") else 1 + 6)
    assert summary[:, :, 3].sum().item() == summary[1, 0, 3].item()
    assert torch.isfinite(summary).all()
    torch.testing.assert_close(summary[0], clean[0])


@needs_kernel
@settings(deadline=None, max_examples=60)
@given(L=st.integers(1, 3), B=st.integers(1, 3), H=st.integers(1, 3), T=st.integers(1, 41), spread=st.floats(0.01, 60),
       mask=st.sampled_from(["none", "rows", "layers"]), bad=st.sampled_from([None, "nan", "inf", "-inf"]),
       sink=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_the_compiled_statistics_equal_torchs_passes(L, B, H, T, spread, mask, bad, sink, seed):
    # GIVEN each layer's scores as attention leaves them (not stacked), some keys hidden, perhaps a
    # non-finite score (visible or not), and garbage behind the hidden keys
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(L, B, H, T, generator=g) * spread
    keep = {"none": None, "rows": torch.rand(B, T, generator=g) > 0.3,
            "layers": torch.rand(L, B, T, generator=g) > 0.3}[mask]
    if bad is not None:
        scores.view(-1)[torch.randint(0, scores.numel(), (2,), generator=g)] = float(bad)
    # WHEN the statistics are taken by the compiled pass over the layers as they are, and by torch
    got = layer_stats([Newest(s) for s in scores.unbind(0)], keep, sink_tokens=sink, per_head=True)
    want = attention_stats(scores, keep, sink_tokens=sink, per_head=True)
    # THEN every statistic, per row and per head, is the same to float32 rounding
    for a, b in ((got.summary, want.summary), (got.heads_entropy, want.heads_entropy),
                 (got.heads_max_logit, want.heads_max_logit)):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-5)


def test_statistics_off_the_cpu_kernels_path_fall_back_to_torch(monkeypatch):
    # GIVEN no compiled kernel (no compiler here), and bf16 scores (a bf16 model on a GPU)
    scores = torch.randn(2, 1, 3, 9, generator=torch.Generator().manual_seed(1))
    want = attention_stats(scores, None, sink_tokens=2).summary
    monkeypatch.setattr(attention, "_stats_kernel", lambda: None)
    # THEN layer_stats gives torch's statistics either way
    torch.testing.assert_close(layer_stats([Newest(s) for s in scores.unbind(0)], None, sink_tokens=2).summary, want)
    monkeypatch.undo()
    low = layer_stats([Newest(s) for s in scores.bfloat16().unbind(0)], None, sink_tokens=2).summary
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), want, atol=0.05, rtol=0.02)


@needs_kernel
def test_the_compiled_statistics_refuse_shapes_they_would_read_past():
    # GIVEN layers whose scores do not share one shape, and a mask of the wrong length
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(1, 3, 9, generator=g), torch.randn(1, 3, 7, generator=g)
    # THEN each is a clear error, not a read past the end of a tensor
    with pytest.raises(ValueError, match="must be"):
        layer_stats([Newest(a), Newest(b)], None, sink_tokens=2)
    with pytest.raises(RuntimeError):
        layer_stats([Newest(a), Newest(a)], torch.ones(1, 5, dtype=torch.bool), sink_tokens=2)
    # AND one mask given for one layer (1, B, T) spreads over every layer, as torch's passes broadcast it
    keep = torch.rand(1, 1, 9, generator=g) > 0.3
    got = layer_stats([Newest(a), Newest(a * 2)], keep, sink_tokens=2).summary
    torch.testing.assert_close(got, attention_stats(torch.stack([a, a * 2]), keep, sink_tokens=2).summary,
                               atol=3e-5, rtol=3e-5)
