"""SmolLM2-135M-Instruct with the prefix cache: chat requests sharing the demo's system prompt get the same
greedy tokens as without the cache, most of their prompt is served from it, and the checks find nothing."""

from __future__ import annotations

import pytest

from kvdoctor.demo import PROMPTS, SYSTEM_PROMPT
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.session import Session

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def serve(smol, prefix_cache: bool):
    """Three chat requests: two admitted together, then one more as they finish; a small device tier."""
    runner = Runner.create(smol.model, tokenizer=smol.tokenizer, block_size=16, device_blocks=20, host_blocks=16,
                           prefix_cache=prefix_cache, stats_every=0)
    session = Session.on_bus(runner.bus)
    sched = Scheduler(runner, max_batch=2)
    for text in PROMPTS[:3]:
        sched.submit(Request(runner.encode(text, chat=True, system=SYSTEM_PROMPT), max_new_tokens=8, ignore_eos=True))
    sched.run()
    stats = runner.cache.stats().get("prefix")
    runner.close()
    session.close()
    return [g.token_ids for _, g in sorted(sched.done.items())], session.findings, stats


def test_greedy_tokens_match_without_the_cache_and_the_run_is_clean(smol):
    plain, plain_findings, _ = serve(smol, False)
    cached, findings, stats = serve(smol, True)
    assert cached == plain
    assert [f.message for f in plain_findings + findings] == []
    # the third request reuses the system prompt's full blocks (the first two started before any was cached)
    assert stats["hit_blocks"] >= 4 and stats["hit_rate"] > 0.25
