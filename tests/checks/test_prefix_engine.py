"""The engine's prefix cache under the checks, on the real model path (the tiny random Llama): a clean
prefix-cached run gives no finding and the same greedy tokens as without the cache, and each prefix-cache
fault is caught, naming the request that was served the wrong K/V, the block and the step."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from kvdoctor.engine.model.model import tiny_llama  # noqa: E402
from kvdoctor.engine.serving.runner import Runner  # noqa: E402
from kvdoctor.engine.serving.scheduler import Request, Scheduler  # noqa: E402
from kvdoctor.session import Session  # noqa: E402

_rng = random.Random(7)
SYSTEM = [_rng.randrange(3, 128) for _ in range(30)]  # a shared system prompt: 7 full blocks of 4
OTHER = [_rng.randrange(3, 128) for _ in range(30)]  # another one


def ask(system, n=5):
    return system + [_rng.randrange(3, 128) for _ in range(n)]


# (request, prompt, tokens to generate, adapter), submitted in this order
PLAN = [("A", ask(SYSTEM), 4, None), ("B", ask(SYSTEM), 12, None), ("C", ask(OTHER), 6, None),
        ("D", ask(SYSTEM), 6, None), ("E", ask(SYSTEM), 6, "lora-x")]


def serve(prefix_cache: bool, fault: str | None = None, **tiers):
    """A: a request with the system prompt; B: the same prompt, admitted while A runs, outliving it; C: another
    system prompt alone (new blocks while only the cache holds the first prompt's); D: the first prompt again;
    E: the first prompt under an adapter. Returns each request's greedy tokens and the session's findings."""
    lm = tiny_llama(num_layers=2, max_position_embeddings=512)
    tiers = {"device_blocks": 64, "host_blocks": 16, "disk_blocks": 0, **tiers}
    runner = Runner.create(lm.model, block_size=4, prefix_cache=prefix_cache, fault=fault, stats_every=0, **tiers)
    session = Session.on_bus(runner.bus)
    sched = Scheduler(runner, max_batch=4)
    for seq, prompt, new, adapter in PLAN:
        sched.submit(Request(prompt, max_new_tokens=new, ignore_eos=True, adapter=adapter, seq=seq))
        sched.step()
        if seq != "A":  # B joins A one step in; the later ones run alone
            sched.run()
    stats = runner.cache.stats()["prefix"] if prefix_cache else None
    runner.close()
    session.close()
    return {s: g.token_ids for s, g in sched.done.items()}, session, stats


def test_greedy_tokens_are_the_same_with_the_prefix_cache_and_the_clean_run_has_no_finding():
    plain, s0, _ = serve(False)
    cached, s1, stats = serve(True)
    assert cached == plain
    assert [f.message for f in s0.findings + s1.findings] == []
    # of each 35-token prompt's 8 full blocks before its last token, B and D reuse the 7 system-prompt blocks
    # and compute their 8th; A, C and E (another adapter) compute all 8
    assert (stats["hit_blocks"], stats["miss_blocks"], stats["hit_tokens"]) == (14, 2 + 3 * 8, 56)


def test_a_tight_device_keeps_the_run_clean_while_cached_blocks_move_down_and_are_evicted():
    plain, _, _ = serve(False, device_blocks=12, host_blocks=4)
    cached, session, stats = serve(True, device_blocks=12, host_blocks=4)
    assert cached == plain
    assert [f.message for f in session.findings] == []
    assert stats["hit_blocks"] > 0


@pytest.mark.parametrize("fault, rule, seq", [
    ("prefix-unsalted", "prefix/hash-mismatch", "E"),  # E's adapter was left out of the key: it took A's blocks
    ("prefix-overwritten", "prefix/rewritten-hit", "D"),  # C wrote over a cached block of the system prompt
    ("prefix-freed-in-use", "stale/read-freed", "B"),  # A's end dropped the blocks B was reading
])
def test_each_prefix_cache_fault_is_caught_naming_request_block_and_step(fault, rule, seq):
    _, session, _ = serve(True, fault)
    hits = [f for f in session.findings if f"{f.check}/{f.rule}" == rule]
    assert hits, [f"{f.check}/{f.rule}" for f in session.findings]
    assert {f.seq for f in hits} == {seq}
    for f in hits:
        assert f.block is not None and f.step is not None
        assert any(e["kind"] == "share" and e.get("hash") for e in f.evidence["history"])  # a cached block
