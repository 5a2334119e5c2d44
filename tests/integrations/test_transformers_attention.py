"""The observer's attention statistics: the batched per-step pass gives, for every layer and row, what a
plain per-row computation of the newest query's scores gives (grouped-query heads, left padding,
mixed masks), and counts non-finite scores only where the query sees them."""

from __future__ import annotations

import math

import pytest
import torch

from kvdoctor.integrations.transformers_attention import AttentionTap

BLOCK = 4


class _Layer:
    def __init__(self, layer_idx: int, scaling: float) -> None:
        self.layer_idx = layer_idx
        self.scaling = scaling


def _reference(q, k, visible, scale):
    """Per row, by the definitions of the attn event: q (H, D) newest query, k (H_kv, T, D), visible (T,) bool."""
    H, Hkv = q.shape[0], k.shape[0]
    scores = torch.stack([q[h] @ k[h // (H // Hkv)].T for h in range(H)]).double() * scale  # (H, T)
    seen = scores[:, visible]
    nonfinite = int((~torch.isfinite(seen)).sum())
    probs = torch.softmax(seen, dim=-1)
    entropy = float(-(probs * probs.clamp_min(1e-300).log()).sum(-1).mean())
    return [float(seen.max()), entropy, float(probs[:, :BLOCK].sum(-1).mean()), nonfinite]


def _masks(kind, B, T):
    visible = torch.ones(B, T, dtype=torch.bool)
    visible[0, :5] = False  # row 0 left-padded by 5
    if kind == "none":
        return None, torch.ones(B, T, dtype=torch.bool)
    if kind == "bool":
        return visible.view(B, 1, 1, T), visible
    additive = torch.zeros(B, 1, 1, T).masked_fill(~visible.view(B, 1, 1, T), torch.finfo(torch.float32).min)
    return additive, visible


@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_the_batched_statistics_equal_a_per_row_computation(kind):
    # GIVEN three layers of grouped-query attention (6 heads over 2 K heads) for 3 rows, one left-padded
    torch.manual_seed(1)
    B, H, Hkv, T, D, scale = 3, 6, 2, 21, 8, 0.3
    mask, visible = _masks(kind, B, T)
    tap = AttentionTap(BLOCK)
    tap.begin()
    inputs = []
    for layer in range(3):
        q = torch.randn(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D) as transformers lays out a decoding query
        k = torch.randn(B, Hkv, T, D)
        tap._observe(_Layer(layer, scale), q, k, mask, None)
        inputs.append((q, k))
    # WHEN the pass ends
    stats = dict(tap.finish())
    # THEN each layer and row has what the per-row definition gives
    assert sorted(stats) == [0, 1, 2] and tap.kv_len == {0: T, 1: T, 2: T}
    for layer, (q, k) in enumerate(inputs):
        for b in range(B):
            want = _reference(q[b, :, -1], k[b], visible[b], scale)
            got = stats[layer][b]
            assert got[3] == 0 == want[3]
            assert got[:3] == pytest.approx(want[:3], rel=1e-4, abs=1e-5)


def test_non_finite_scores_are_counted_where_the_query_sees_them_only():
    # GIVEN one layer whose K holds a NaN in a slot row 1 sees and an infinity in a slot row 0's padding hides
    B, H, Hkv, T, D = 2, 4, 2, 12, 4
    mask, visible = _masks("bool", B, T)
    k = torch.randn(B, Hkv, T, D)
    k[1, 0, 7, 0] = math.nan
    k[0, 1, 2, 0] = math.inf
    tap = AttentionTap(BLOCK)
    tap.begin()
    tap._observe(_Layer(0, 0.5), torch.randn(B, 1, H, D).transpose(1, 2), k, mask, None)
    (layer, rows), = tap.finish()
    # THEN row 1 counts the NaN in each of the two query heads of that K head; row 0 is finite and clean
    assert rows[1][3] == 2 and math.isnan(rows[1][1])
    assert rows[0][3] == 0 and all(math.isfinite(v) for v in rows[0][:3])


def test_layers_with_different_masks_are_summarised_apart():
    # GIVEN a full-attention layer and a sliding one that sees only the last 6 keys
    B, H, Hkv, T, D = 1, 2, 1, 10, 4
    full = torch.ones(B, 1, 1, T, dtype=torch.bool)
    window = full.clone()
    window[..., :4] = False
    q, k = torch.randn(B, 1, H, D).transpose(1, 2), torch.randn(B, Hkv, T, D)
    tap = AttentionTap(BLOCK)
    tap.begin()
    tap._observe(_Layer(0, 1.0), q, k, full, None)
    tap._observe(_Layer(1, 1.0), q, k, window, None)
    stats = dict(tap.finish())
    # THEN the sliding layer's entropy is bounded by its 6 keys and its sink is the mass on keys 4..7
    assert stats[1][0][1] <= math.log(6) + 1e-5
    assert stats[1][0] == pytest.approx(_reference(q[0, :, -1], k[0], window.view(T), 1.0), rel=1e-4)
    assert stats[0][0] == pytest.approx(_reference(q[0, :, -1], k[0], full.view(T), 1.0), rel=1e-4)
