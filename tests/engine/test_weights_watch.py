"""The runner's weights as part of a block's identity: a change of the model's parameters is a ``weights``
event, and the prefix cache keys requests after it apart from K/V computed before it (the bug itself, a cache
that ignores the change, is reproduced in tests/field/test_field_bugs.py)."""

from __future__ import annotations

import pytest
import torch

from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.events import Share, Weights
from kvdoctor.session import Session

PROMPT = list(range(3, 40))  # 37 tokens: nine full blocks of 4


@pytest.fixture
def tiny():
    return tiny_llama(num_layers=2, seed=5).model


def _serve(tiny, *, change=None, fault=None):
    """The prompt served, the weights changed by ``change(runner)``, the prompt served again."""
    runner = Runner.create(tiny, block_size=4, device_blocks=64, prefix_cache=True, stats_every=0, fault=fault)
    events = []
    runner.bus.subscribe(events.extend)
    session = Session.on_bus(runner.bus)
    runner.generate([PROMPT], max_new_tokens=3)
    if change is not None:
        change(runner)
    runner.generate([PROMPT], max_new_tokens=3)
    runner.close()
    session.close()
    return session.findings, events


def _scale_keys(model):
    for layer in model.model.layers:
        layer.self_attn.k_proj.weight.mul_(2.0)


def _hits(events):
    return [e for e in events if type(e) is Share and e.hash is not None and e.seq != "prefix-cache"]


def test_a_clean_run_hits_its_prefix_and_says_nothing_of_weights(tiny):
    findings, events = _serve(tiny)
    assert _hits(events) and not [e for e in events if type(e) is Weights]
    assert [f.message for f in findings] == []


@pytest.mark.parametrize("how", ["update_weights", "in place"])
def test_a_weight_change_is_an_event_and_the_next_request_computes_its_own_kv(tiny, how):
    # GIVEN the weights changed between two requests with one prompt: through the runner, or behind its back
    def change(runner):
        if how == "update_weights":
            runner.update_weights(_scale_keys, detail="trainer step 1")
        else:
            with torch.no_grad():
                _scale_keys(runner.model)

    findings, events = _serve(tiny, change=change)
    # THEN one weights event, with what did it, and the second request hit nothing of the first's
    (w,) = [e for e in events if type(e) is Weights]
    assert w.version == 1 and w.digest
    assert w.detail == ("trainer step 1" if how == "update_weights" else "the model's parameters were changed in place")
    first_end = next(i for i, e in enumerate(events) if type(e) is Weights)
    assert not _hits(events[first_end:])
    assert [f.message for f in findings] == []
