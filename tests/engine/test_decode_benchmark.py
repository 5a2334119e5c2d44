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


def test_loading_the_benchmark_leaves_the_path_as_it_was(bench):
    # GIVEN the decode benchmark loaded (it imports its sibling scripts) THEN its folder is not left on the
    # path, where its vllm.py would shadow vLLM for every later import in the process
    import importlib.util
    import sys
    from pathlib import Path

    here = str(Path(bench.__file__).resolve().parent)
    assert here not in [str(Path(p).resolve()) for p in sys.path if p]
    spec = importlib.util.find_spec("vllm")
    assert spec is None or not str(spec.origin).startswith(here)
