"""NaN written into real slots is found at the write that stored it (``engine.kv.nonfinite``,
``slots/nonfinite-write``)."""

from __future__ import annotations

import pytest

from kvdoctor.checks import make_suite
from kvdoctor.engine.kv import nonfinite
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.events import Write

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]


def _run(compiled: bool, fault: str | None, monkeypatch):
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "1" if compiled else "0")
    model = tiny_llama(hidden_size=128, intermediate_size=256, num_layers=4).model
    events, suite = [], make_suite()
    with Runner.create(model, block_size=4, device_blocks=96, host_blocks=0, fault=fault) as runner:
        runner.bus.subscribe(events.extend)
        runner.bus.subscribe(suite.observe_many)
        runner.generate(PROMPTS, max_new_tokens=8)
        runner.bus.flush()
        hit = runner.cache.faults.hit
    suite.finish()
    return events, suite.findings, hit


@pytest.mark.parametrize("compiled,look", [(True, "compiled"), (False, "compiled"), (False, "torch")],
                         ids=["compiled-layers", "torch-layers", "torch-layers-torch-look"])
def test_nan_written_into_a_real_slot_is_named_at_its_write(monkeypatch, compiled, look):
    # GIVEN a run whose store writes a NaN into one token's keys at the middle layer (the nonfinite-write fault),
    # the stored rows looked at by the compiled loop or by torch (where nothing compiles)
    if look == "torch":
        monkeypatch.setattr(nonfinite, "_rows_kernel", lambda: None)
    events, findings, hit = _run(compiled, "nonfinite-write", monkeypatch)
    # THEN the write event says so, and slots/nonfinite-write names the sequence, block, position, layer, step
    # and the line that ran the step
    (w,) = [e for e in events if isinstance(e, Write) and e.nonfinite and e.step == hit["step"] and e.seq == hit["seq"]]
    assert (w.block, w.nonfinite, w.nonfinite_layer) == (hit["block"], [hit["pos"]], hit["layer"])
    (f,) = [f for f in findings if f.rule == "nonfinite-write"]
    assert (f.seq, f.block, f.layer, f.step, f.evidence["positions"]) == (
        hit["seq"], hit["block"], hit["layer"], hit["step"], [hit["pos"]])
    assert f.code_location is not None and f.code_location[0].endswith("test_nonfinite_write.py")
    # AND the NaN's spread to the layers above and later steps is no finding of its own
    assert {x.rule for x in findings if x.check == "slots"} == {"nonfinite-write"}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-layers", "torch-layers"])
def test_a_clean_run_writes_no_nonfinite_kv_and_gives_no_finding(monkeypatch, compiled):
    events, findings, _ = _run(compiled, None, monkeypatch)
    assert findings == [] and not any(e.nonfinite for e in events if isinstance(e, Write))
