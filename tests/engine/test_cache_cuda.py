"""The cache on a CUDA device: pinned host arena, swaps and prefetch on a side stream."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_round_trip_through_every_tier_on_cuda(make_cache):
    r = make_cache(device="cuda", prefetch_depth=4)
    assert r.cache.arenas["host"].data.is_pinned() and r.cache.arenas["device"].data.is_cuda
    for i in range(5):
        r.add(i, 8)
        r.cache.end_step()
    r.cache.prefetch(0)
    for i in range(5):
        r.assert_intact(i)  # gather returns device tensors; compare on the CPU
        r.cache.end_step()
    assert r.cache.stats()["prefetch_hits"] >= 1
    r.cache.pool.check()
