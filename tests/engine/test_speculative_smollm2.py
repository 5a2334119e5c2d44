"""SmolLM2-135M-Instruct with speculative decoding: prompt lookup on an edit prompt (where it helps) and a free
one (where it does not), batched together with the prefix cache on, gives plain greedy decoding's tokens
and a run without findings."""

from __future__ import annotations

import pytest

from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.engine.serving.speculative import NgramDrafter
from kvdoctor.session import Session

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TEXTS = [
    "Repeat the following text exactly: A paged KV cache stores the keys and values of every token in "
    "fixed-size blocks, and swaps them to host memory when the device is full.",
    "Write a short poem about the sea.",
]


def serve(smol, speculative: bool):
    runner = Runner.create(smol.model, tokenizer=smol.tokenizer, block_size=16, device_blocks=32, host_blocks=8,
                           prefix_cache=True, stats_every=0)
    session = Session.on_bus(runner.bus)
    sched = Scheduler(runner, max_batch=2, drafter=NgramDrafter() if speculative else None, num_draft=4)
    seqs = [sched.submit(Request(runner.encode(t, chat=True), max_new_tokens=24, ignore_eos=True)) for t in TEXTS]
    sched.run()
    runner.close()
    session.close()
    return [sched.done[s].token_ids for s in seqs], session.findings, sched.spec_stats()


def test_prompt_lookup_keeps_greedy_tokens_and_the_run_clean(smol):
    plain, plain_findings, _ = serve(smol, False)
    spec, findings, stats = serve(smol, True)
    assert spec == plain
    assert [f.message for f in plain_findings + findings] == []
    assert stats["accepted"] > 0 and stats["tokens_per_forward"] > 1.2
