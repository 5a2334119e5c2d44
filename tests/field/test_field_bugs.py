"""Field bugs reproduced on kvdoctor's own engine and on transformers, one test per class, each named after the
reports it reproduces, with a clean twin that gives no finding (docs: /work/shared FIELD-BUGS classes).

The engine runs a tiny random Llama (fixed seed) with its prefix cache; the bug is switched on by a named fault
(``prefix-unsalted``: a cache keyed by tokens alone) or by what the report's user did. The classes vLLM's CPU
build runs are reproduced on real vLLM in tests/integrations/test_vllm*.py (``./kvd test-vllm``); transformers'
cache API in tests/integrations/test_transformers_cache_api.py.
"""

from __future__ import annotations

import pytest

from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.session import Session

PROMPT = list(range(3, 40))  # 37 tokens: nine full blocks of 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(num_layers=2, seed=5).model


def _serve(tiny, requests, *, fault=None, between=None):
    """``requests`` (adapter names) served one after another on one prefix-cached runner; ``between(runner)``
    after the first. Returns the findings."""
    runner = Runner.create(tiny, block_size=4, device_blocks=64, prefix_cache=True, stats_every=0, fault=fault)
    session = Session.on_bus(runner.bus)
    sched = Scheduler(runner, max_batch=1)
    for i, adapter in enumerate(requests):
        if i == 1 and between is not None:
            between(runner)
        sched.submit(Request(PROMPT, max_new_tokens=3, ignore_eos=True, adapter=adapter))
        sched.run()
    runner.close()
    session.close()
    return session.findings


def _trainer_step(runner):
    def scale_keys(model):
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)

    runner.update_weights(scale_keys, detail="trainer step 1")


@pytest.mark.parametrize("fault", ["prefix-unsalted", None])
def test_stale_kv_after_a_weight_sync(tiny, fault):
    """NVIDIA-NeMo/RL #4018, prime-rl #1650, lmdeploy #4917: a rollout after a weight update hits K/V of the
    old weights because nothing reset or re-salted the prefix cache."""
    findings = _serve(tiny, [None, None], fault=fault, between=_trainer_step)
    if fault is None:  # the clean twin: the engine salts with the new weights, the second request computes its own
        assert [f.message for f in findings] == []
        return
    stale = [f for f in findings if f.rule == "stale-prefix-hit"]
    assert len(stale) == 1, findings
    assert "computed under weights v0; weights are v1" in stale[0].message and "trainer step 1" in stale[0].message
    assert isinstance(stale[0].block, int) and stale[0].seq is not None


@pytest.mark.parametrize("fault", ["prefix-unsalted", None])
def test_a_prefix_key_without_the_adapter_shares_blocks_across_adapters(tiny, fault):
    """vllm #3264, #30931 (and xllm PR #2047): the prefix key leaves the adapter out, so a request under one
    LoRA hits blocks another computed."""
    findings = _serve(tiny, ["sql", "chat"], fault=fault)
    if fault is None:
        assert [f.message for f in findings] == []
        return
    (f,) = [f for f in findings if f.check == "adapters"]
    assert f.rule == "foreign-hit" and isinstance(f.block, int)
    assert "under adapter 'sql'" in f.message and "runs under adapter 'chat'" in f.message
