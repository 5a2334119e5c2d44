"""Top-p's nucleus found over numpy's sort of the scores gives the very distribution torch's sort of scores and
indices gave (so the tokens drawn from it are the same), ties at the cut and rounding included."""

from __future__ import annotations

import torch

from kvdoctor.engine.model import sampling as sampling_mod
from kvdoctor.engine.model.sampling import SamplingParams, sampling_probs

_SORT = torch.sort  # the reference's own, whatever a test counts


def _nucleus_by_torch_sort(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus as the engine cut it before: from torch's sort of scores and indices."""
    sorted_scores, order = _SORT(scores, descending=True)
    cum = torch.softmax(sorted_scores, -1).cumsum(-1)
    drop = cum - torch.softmax(sorted_scores, -1) >= top_p
    return scores.scatter(0, order[drop], float("-inf"))


def _logits(i: int, g: torch.Generator) -> torch.Tensor:
    """Logits of many shapes: plain, rounded into many ties, with NaNs, bf16, and signed zeros."""
    size = (49152, 1000, 7, 2)[i % 4]
    x = torch.randn(size, generator=g) * float(torch.rand(1, generator=g) * 8 + 0.1)
    kind = i % 5
    if kind == 1:
        x = (x * 2).round() / 2
    elif kind == 2:
        x[torch.rand(size, generator=g) < 0.3] = float("nan")
    elif kind == 3:
        x = x.to(torch.bfloat16)
    elif kind == 4:
        x[: size // 2] = 0.0
        x[size // 4: size // 2] = -0.0
    return x


def test_the_nucleus_is_the_same_bits_as_over_torchs_sort(monkeypatch):
    # GIVEN logits of every kind and sampling settings of every kind, and a count of torch's sorts (the fallback)
    sorts = []
    monkeypatch.setattr(sampling_mod.torch, "sort", lambda *a, **k: (sorts.append(1), _SORT(*a, **k))[1])
    g = torch.Generator().manual_seed(0)
    cases = 400
    for i in range(cases):
        params = SamplingParams(greedy=False, temperature=(0.8, 1.0, 0.3)[i % 3], top_k=(0, 0, 40)[i % 3],
                                top_p=(0.95, 0.5, 0.9, 0.999, 0.01)[i % 5 if i % 7 else 2])
        logits = _logits(i, g)
        # WHEN the distribution is computed THEN it is exactly the one torch's sort gave
        ours = sampling_probs(logits, params)
        with monkeypatch.context() as before:
            before.setattr(sampling_mod, "_nucleus", _nucleus_by_torch_sort)
            theirs = sampling_probs(logits, params)
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (i, params)
    # THEN both ways were taken: numpy's sort for most, torch's where ties met the cut
    assert 0 < len(sorts) < cases // 4
