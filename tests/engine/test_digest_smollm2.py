"""Each content fault on SmolLM2-135M-Instruct, caught by the integrity check naming the corrupted block
and its sequence; the same workload without a fault gives no finding at all.

One slow module (it loads the embedded model once): four short requests, three at a time, so the
fourth takes slots the first left behind (what stale-slot needs), every read verified.
"""

from __future__ import annotations

import pytest

from kvdoctor.checks import make_suite
from kvdoctor.engine.faults import CONTENT_FAULTS
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TEXTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
         "Caches are a good example of"]


def run(smol, fault, *, tokens=(2, 6, 6, 5), **verify):
    verify = verify or {"verify": "full"}
    runner = Runner.create(smol.model, tokenizer=smol.tokenizer, block_size=4, device_blocks=64,
                           host_blocks=8, fault=fault, codec="nf4" if fault == "wrong-scale" else None, **verify)
    suite = make_suite()
    runner.bus.subscribe(suite.observe_many)
    sched = Scheduler(runner, max_batch=3)
    for text, n in zip(TEXTS, tokens):
        sched.submit(Request(runner.encode(text), max_new_tokens=n, ignore_eos=True))
    sched.run()
    runner.close()
    suite.finish()
    return suite.findings, runner.cache.faults.hit


def test_each_content_fault_is_caught_on_smollm2_naming_block_and_sequence(smol):
    found, _ = run(smol, None)
    assert [f"{f.check}/{f.rule}: {f.message}" for f in found] == []
    for fault in CONTENT_FAULTS:
        found, hit = run(smol, fault)
        assert hit is not None, f"{fault} never fired"
        assert found and {f.check for f in found} == {"integrity"}, (fault, [f.message for f in found])
        first = found[0]
        assert (first.block, first.seq, first.step) == (hit["block"], hit["seq"], hit["step"]), (fault, first.message)
        if hit["layer"] is not None:
            assert first.layer == hit["layer"], fault


@pytest.mark.parametrize("fault", ["overwrite-foreign", "bit-flip", "zeroed-block", "noise"])
def test_the_default_sweep_finds_each_content_fault_within_n_steps(smol, fault):
    # GIVEN the default verification (the sweep) with N = 8, requests of 4-6 blocks decoding 14 tokens
    found, hit = run(smol, fault, tokens=(14, 14, 14, 14), verify="sample", verify_every=8)
    # THEN the corrupted block is found, named, within N steps of the fault (every read block's bound)
    assert hit is not None and found and {f.check for f in found} == {"integrity"}, (fault, found)
    first = found[0]
    assert (first.block, first.seq) == (hit["block"], hit["seq"]) and first.step - hit["step"] <= 8, first.message
