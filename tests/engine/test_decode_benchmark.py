"""The decode benchmark's bandwidth bound calls the projection kernels as the runner does."""

from __future__ import annotations

import pytest
import torch

from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("decode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_passes_every_projection_once(bench, dtype):
    # GIVEN a runner on a small model (its projections on the C kernel where there is one)
    model = tiny_llama(seed=0, dtype=dtype).model
    with Runner.create(model, block_size=4, device_blocks=16, host_blocks=0) as runner:
        # WHEN the bound is measured THEN it reports every projection's bytes, read at a finite positive rate
        bound = bench.weight_bound(runner, 2)
    weights = [p.weight for w in runner._weights for p in (w.qkv, w.o, w.gate_up, w.down)] + [runner._lm_head.weight]
    assert bound["weight_mb"] == round(sum(w.nbytes for w in weights) / 2**20, 1)
    assert bound["ms"] > 0 and bound["gb_s"] > 0 and bound["tok_s"] > 0
