"""The checks on the embedded SmolLM2-135M: clean serving runs raise nothing of any severity, judged
against the shipped attention profile (the trace header names the model) and against ranges learned
from the trace itself; the attention-nan fault is still caught."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def smollm2():
    from kvdoctor.engine.model.model import load_model

    return load_model()


def serve(lm, fault, steps: int):
    from kvdoctor.demo import PROMPTS
    from kvdoctor.engine.serving.runner import Runner, SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler
    from kvdoctor.events import SwapOut
    from kvdoctor.session import Session

    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, block_size=16, device_blocks=12, host_blocks=64,
                           fault=fault, extra={"model": lm.name})
    session = Session.on_bus(runner.bus, header=runner.cache.header())
    swaps: list = []
    runner.bus.subscribe(lambda evs: swaps.extend(e for e in evs if isinstance(e, SwapOut)))
    sched = Scheduler(runner, max_batch=4)
    rng = random.Random(0)
    greedy = fault == "attention-nan"  # NaN logits cannot be sampled from
    for _ in range(steps):
        while len(sched.live) < 4:
            sampling = SamplingParams(greedy=True) if greedy else SamplingParams(
                greedy=False, temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 20))
            sched.submit(Request(runner.encode(rng.choice(PROMPTS), chat=True), max_new_tokens=rng.randint(8, 40),
                                 sampling=sampling))
        sched.step()
    runner.close()
    session.close()
    return session, swaps


def test_clean_smollm2_serving_with_swaps_raises_no_finding(smollm2):
    # GIVEN 30 steps of sampled chat requests, four at a time, through a 12-block device tier
    session, swaps = serve(smollm2, None, 30)
    # THEN requests were preempted by swapping, and not one finding was raised
    assert swaps
    assert [f.message for f in session.findings] == []
    assert session.num_events > 300  # one attn_step a step stands for 4 rows x 30 layers of statistics


@pytest.mark.parametrize("profile", ["auto", "none"])
def test_four_greedy_chat_requests_of_48_tokens_raise_nothing(smollm2, profile):
    # GIVEN the run issue 14 measured (4 sink-shift warnings on the first version of the attention check)
    from kvdoctor.config import Config
    from kvdoctor.demo import PROMPTS
    from kvdoctor.engine.serving.runner import Runner, SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler
    from kvdoctor.session import Session

    runner = Runner.create(smollm2.model, tokenizer=smollm2.tokenizer, extra={"model": smollm2.name})
    config = Config(attention_profile=profile)
    session = Session.on_bus(runner.bus, config, header=runner.cache.header())
    sched = Scheduler(runner, max_batch=4)
    for prompt in PROMPTS[:4]:
        sched.submit(Request(runner.encode(prompt, chat=True), max_new_tokens=48, ignore_eos=True,
                             sampling=SamplingParams(greedy=True)))
    # WHEN they run to the end with every check live, with the shipped profile or learning from the trace
    sched.run()
    runner.close()
    session.close()
    # THEN there is no finding of any severity
    assert [f.message for f in session.findings] == []
    attention = next(c for c in session.suite.checks if c.name == "attention")
    assert (attention.profile is not None) == (profile == "auto")


def test_attention_nan_on_smollm2_names_the_layer_and_sequence(smollm2):
    session, _ = serve(smollm2, "attention-nan", 6)
    hits = [f for f in session.findings if f.rule == "nonfinite"]
    # the fault corrupts the middle layer; the NaN then flows into every later layer
    assert hits and min(f.layer for f in hits) == smollm2.config.num_hidden_layers // 2
    assert all(f.seq is not None for f in hits)
