"""Every implementation of the attention statistics against one reference (tests/attention_reference.py):
the engine's torch passes, its compiled kernel and the transformers observer's pass, on the same random
scores of grouped-query heads, with padding and holes in what the newest query sees, and with NaN and
infinities among the scores."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import newest_query_stats as reference, nonfinite_scores
from kvdoctor.engine.model.attention import Newest, _stats_kernel, attention_stats, layer_stats
from kvdoctor.integrations.transformers_attention import AttentionTap, newest_query_stats as observer_stats

SINK = 4  # tokens in the first block


class _Layer:
    """What the observer reads of a transformers attention module."""

    def __init__(self, layer_idx: int, scaling: float) -> None:
        self.layer_idx = layer_idx
        self.scaling = scaling


@st.composite
def cases(draw):
    """Shapes of grouped-query attention, a scale, and the keys each row's newest query sees: all, a
    right-padded prefix, or holes, always including the first block (where the observer's "first keys
    it sees" and the engine's "first positions" are the same keys)."""
    L, B = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Hkv, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    T, D = draw(st.integers(SINK + 1, 40)), draw(st.sampled_from([4, 8]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["all", "padded", "holes"]))
    visible = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        if kind == "padded":
            visible[b, draw(st.integers(SINK, T)):] = False
        elif kind == "holes":
            visible[b, SINK:] = torch.rand(T - SINK, generator=gen) < 0.7
    return dict(L=L, B=B, H=Hkv * group, Hkv=Hkv, T=T, D=D, gen=gen, spread=draw(st.sampled_from([0.5, 3.0, 12.0])),
                visible=None if kind == "all" else visible)


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(L, B, H, T) scaled scores of newest queries q (L, B, H, D) on keys k (L, B, H_kv, T, D)."""
    group = q.shape[2] // k.shape[2]
    return torch.einsum("lbhd,lbhtd->lbht", q, k.repeat_interleave(group, dim=2)) * scale


def _engine(scores: torch.Tensor, visible: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The engine's implementations that apply on this machine, each as (L, B, 4)."""
    out = {"engine torch": attention_stats(scores, visible, sink_tokens=SINK).summary}
    if _stats_kernel() is not None:
        out["engine kernel"] = layer_stats([Newest(s) for s in scores], visible, sink_tokens=SINK).summary
        if not bool(torch.isfinite(scores).all()):
            return out
        probs = torch.softmax(scores if visible is None else scores.masked_fill(~visible[None, :, None], -math.inf), -1)
        out["engine kernel, from probabilities"] = layer_stats(
            [Newest(s, p) for s, p in zip(scores, probs)], visible, sink_tokens=SINK).summary
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


@settings(max_examples=40, deadline=None)
@given(cases())
def test_every_implementation_gives_the_reference_statistics_on_finite_scores(case):
    # GIVEN newest queries and keys of grouped-query heads, and the scores they make
    L, B, H, Hkv, T, D, gen = (case[k] for k in ("L", "B", "H", "Hkv", "T", "D", "gen"))
    q = torch.randn(L, B, H, D, generator=gen) * case["spread"]
    k = torch.randn(L, B, Hkv, T, D, generator=gen)
    scale = D ** -0.5
    scores, visible = _grouped_scores(q, k, scale), case["visible"]
    want = reference(scores, visible, SINK)
    # WHEN the engine's passes take the scores THEN they give the reference's statistics
    for name, got in _engine(scores, visible).items():
        _close(got, want, name)
    # WHEN the observer takes the same queries and keys as transformers hands them over
    tap = AttentionTap(SINK)
    tap.begin()
    mask = None if visible is None else visible.view(B, 1, 1, T)
    for layer in range(L):
        tap._observe(_Layer(layer, scale), q[layer].unsqueeze(2), k[layer], mask, None)  # q (B, H, 1, D)
    # THEN it gives them too
    _close(torch.tensor([rows for _, rows in sorted(tap.finish())]), want, "observer")


@settings(max_examples=40, deadline=None)
@given(cases(), st.data())
def test_non_finite_scores_are_judged_alike(case, data):
    # GIVEN scores with NaN and infinities here and there, some where the query sees them, some in hidden
    # keys, and now and then a head with no finite score at all
    L, B, H, T, gen = (case[k] for k in ("L", "B", "H", "T", "gen"))
    scores = torch.randn(L, B, H, T, generator=gen) * case["spread"]
    for _ in range(data.draw(st.integers(1, 4))):
        at = tuple(data.draw(st.integers(0, n - 1)) for n in (L, B, H, T))
        scores[at] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    if data.draw(st.booleans()):
        scores[0, 0, 0, :] = data.draw(st.sampled_from([math.nan, -math.inf]))
    visible = case["visible"]
    want = reference(scores, visible, SINK)
    # WHEN the engine's passes take them THEN every statistic is the reference's, counts included
    for name, got in _engine(scores, visible).items():
        _close(got, want, name)
    # WHEN the observer's pass takes them THEN a row is flagged exactly where the reference flags it; the
    # observer counts the seen scores only, and leaves the statistics they poison non-finite
    got = observer_stats(scores, 1.0, visible, SINK)
    counts = nonfinite_scores(scores, visible)
    for layer in range(L):
        for b in range(B):
            row = got[layer][b]
            assert row[3] == int(counts[layer, b]) and (row[3] > 0) == (want[layer, b, 3] > 0)
            if row[3]:
                assert not math.isfinite(row[0] + row[1])
            else:
                _close(torch.tensor(row), want[layer, b], "observer")


def test_the_reference_on_uniform_scores_is_log_t_entropy_and_the_first_blocks_share():
    # GIVEN equal scores over 16 keys, 12 of them seen
    scores = torch.zeros(1, 1, 2, 16)
    visible = torch.arange(16)[None] < 12
    # THEN the entropy is log 12, the sink 4/12, the largest score 0, nothing non-finite
    assert reference(scores, visible, SINK)[0, 0].tolist() == pytest.approx([0.0, math.log(12), 4 / 12, 0.0])
