"""kvdoctor.observe never harms transformers: when the observer's own bookkeeping fails in any hook,
``generate`` gives the same tokens as without it, the trace holds one ``observer_error`` naming the
hook, and the check reports that kvdoctor lost track, nothing else."""

from __future__ import annotations

import pytest
import torch

import kvdoctor
from kvdoctor.checks import make_suite
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.events import ObserverError
from kvdoctor.integrations.transformers import Observer
from kvdoctor.integrations.transformers_attention import AttentionTap
from kvdoctor.integrations.transformers_rows import CacheRows
from kvdoctor.trace import TraceReader

PAD = 0


@pytest.fixture(scope="module")
def models():
    return tiny_llama(num_layers=2, seed=3).model, tiny_llama(num_layers=1, seed=5).model


def _run(models):
    """Assisted decoding (its rejected drafts crop the cache), then a call continuing the returned cache."""
    model, assistant = models
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(0))
    first = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=PAD, assistant_model=assistant,
                           return_dict_in_generate=True)
    more = torch.cat([first.sequences, torch.tensor([[5, 6, 7]])], dim=1)
    return model.generate(more, cache=first.cache, max_new_tokens=6, do_sample=False, pad_token_id=PAD)


HOOKS = {  # the observer's bookkeeping that fails -> the part its observer_error names
    "forward, before": (Observer, "_before", "LlamaForCausalLM.forward"),
    "forward, after": (Observer, "_after", "LlamaForCausalLM.forward"),
    "prepare_inputs_for_generation": (Observer, "_prepare", "LlamaForCausalLM.prepare_inputs_for_generation"),
    "attention": (AttentionTap, "_observe", "attention"),
    "crop": (CacheRows, "crop", ".crop"),
}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_a_failure_in_any_hook_is_one_observer_error_and_generate_is_unchanged(models, tmp_path, monkeypatch, hook):
    plain = _run(models)
    # GIVEN the observer's bookkeeping in one hook raises, as a transformers release that moved something would
    cls, name, part = HOOKS[hook]

    def broken(*args, **kwargs):
        raise KeyError("injected into kvdoctor's bookkeeping")

    monkeypatch.setattr(cls, name, broken)
    # WHEN generate runs observed
    path = tmp_path / "run.kvtrace"
    with kvdoctor.observe(models[0], trace=path):
        observed = _run(models)
    monkeypatch.undo()
    # THEN transformers gave the same tokens, and the trace says where kvdoctor lost track
    assert torch.equal(observed, plain)
    events = list(TraceReader(path))
    errors = [e for e in events if type(e) is ObserverError]
    assert len(errors) == 1 and part in errors[0].part and errors[0].producer == "transformers", errors
    suite = make_suite()
    findings = suite.observe_many(events) + suite.finish()
    assert [(f.check, f.rule) for f in findings] == [("observer", "lost-track")]
    # ... and the model is left as it was found: a second observed call is traced again, cleanly
    with kvdoctor.observe(models[0], trace=tmp_path / "again.kvtrace"):
        assert torch.equal(_run(models), plain)
    suite = make_suite()
    assert suite.observe_many(TraceReader(tmp_path / "again.kvtrace")) + suite.finish() == []
