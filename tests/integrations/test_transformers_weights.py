"""kvdoctor.observe sees the model's weights change between two generate calls: a cache kept across the
change holds K/V of the old model, which the continued call reads (weights/stale-read); a new cache is clean."""

from __future__ import annotations

import pytest
import torch

import kvdoctor
from kvdoctor.checks import make_suite
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.events import Weights
from kvdoctor.trace import TraceReader

PAD = 0


def _update_in_place(model):
    with torch.no_grad():  # an optimizer step: parameters changed in place (their version counters move)
        for p in model.parameters():
            p.mul_(1.01)


def _update_through_data(model):
    for p in model.parameters():  # what some training loops do: no version counter moves, only the values
        p.data.mul_(1.01)


@pytest.mark.parametrize("update", [_update_in_place, _update_through_data])
@pytest.mark.parametrize("keep_cache", [True, False])
def test_a_cache_kept_across_a_weight_update_is_read_stale_and_a_new_one_is_clean(tmp_path, update, keep_cache):
    model = tiny_llama(num_layers=2, seed=3).model
    ids = torch.randint(3, 120, (1, 9), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "run.kvtrace"
    # GIVEN a generate call whose cache the caller keeps, then the model trained in between
    with kvdoctor.observe(model, trace=path):
        first = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True)
        update(model)
        # WHEN generation continues on the kept cache (or starts over)
        more = torch.cat([first.sequences, torch.tensor([[5, 6, 7]])], dim=1)
        cache = {"cache": first.cache} if keep_cache else {}
        model.generate(more, max_new_tokens=4, do_sample=False, pad_token_id=PAD, **cache)
    events = list(TraceReader(path))
    suite = make_suite()
    findings = suite.observe_many(events) + suite.finish()
    # THEN the change is one weights event; only the kept cache's reads are stale
    assert [(e.version, e.cause) for e in events if type(e) is Weights] == [(1, "update")]
    if not keep_cache:
        assert findings == [], [f.message for f in findings]
        return
    assert [(f.check, f.rule, f.severity) for f in findings] == [("weights", "stale-read", "warning")]
    assert "changed since the last generate call" in findings[0].message
