"""Continuous batching: arrivals at any step, admission by free blocks, preemption by swap or recompute, rollback."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving import scheduler
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.events import Batch, Rollback, SeqEnd, SwapIn, SwapOut

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]
NEW = 20


@pytest.fixture(scope="module")
def model():
    return tiny_llama().model


@pytest.fixture(scope="module")
def references(model):
    out = []
    for p in PROMPTS:
        seq = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def _run(model, *, device, host, disk, priorities=(0, 1, 0, 1), max_batch=4):
    runner = Runner.create(model, block_size=4, device_blocks=device, host_blocks=host, disk_blocks=disk)
    seen = []
    runner.bus.subscribe(seen.extend)
    sched = Scheduler(runner, max_batch=max_batch)
    seqs = [sched.submit(Request(p, max_new_tokens=NEW, priority=pr)) for p, pr in zip(PROMPTS, priorities)]
    done = sched.run()
    stats = runner.cache.stats()
    runner.close()
    return [done[s].token_ids for s in seqs], seen, stats


def _assert_same(tokens, references):
    for got, ref in zip(tokens, references):
        assert got == ref[: len(got)] and (len(got) == NEW or got[-1] == 2)


def test_a_roomy_device_runs_everything_together(model, references):
    tokens, seen, stats = _run(model, device=64, host=0, disk=0)
    _assert_same(tokens, references)
    first = next(e for e in seen if isinstance(e, Batch))
    assert len(first.rows) == 4 and not any(isinstance(e, (SwapOut, SwapIn)) for e in seen)


def test_a_tiny_device_tier_swaps_through_host_and_disk_without_changing_tokens(model, references):
    # GIVEN a device tier of 16 blocks for ~34 blocks of work, a 6-block host and a disk tier
    tokens, seen, stats = _run(model, device=16, host=6, disk=64)
    # THEN lower-priority requests were swapped out and back in, to host and to disk
    swaps = Counter((e.src, e.dst) for e in seen if isinstance(e, (SwapOut, SwapIn)))
    assert swaps[("device", "host")] and swaps[("device", "disk")]
    assert swaps[("host", "device")] and swaps[("disk", "device")]
    # AND every request still produced transformers' tokens
    _assert_same(tokens, references)
    assert stats["tiers"]["device"]["used_blocks"] == 0


def test_without_a_slower_tier_preemption_recomputes(model, references):
    tokens, seen, _ = _run(model, device=16, host=0, disk=0)
    assert any(isinstance(e, Rollback) for e in seen)  # the preempted sequence's K/V was dropped
    _assert_same(tokens, references)


def test_higher_priority_runs_first_when_only_one_fits(model):
    runner = Runner.create(model, block_size=4, device_blocks=11, host_blocks=64)
    sched = Scheduler(runner, max_batch=4)
    low = sched.submit(Request(PROMPTS[2], max_new_tokens=3, priority=0))
    high = sched.submit(Request(PROMPTS[0], max_new_tokens=3, priority=5))
    first = sched.step()
    assert first.rows == [high]  # the 37-token prompt (10 blocks) does not fit beside its 2 blocks in 11
    sched.run()
    assert set(sched.done) == {low, high}
    runner.close()


def test_requests_arrive_and_leave_at_any_step(model, references):
    runner = Runner.create(model, block_size=4, device_blocks=64, host_blocks=0)
    sched = Scheduler(runner, max_batch=8)
    a = sched.submit(Request(PROMPTS[0], max_new_tokens=NEW))
    for _ in range(3):
        sched.step()
    b = sched.submit(Request(PROMPTS[1], max_new_tokens=5))
    step = sched.step()
    assert step.rows == [a, b]
    sched.run()
    assert sched.done[a].token_ids == references[0][: len(sched.done[a].token_ids)]
    assert sched.done[b].token_ids == references[1][:5]
    runner.close()


def test_rollback_discards_tokens_and_decoding_resumes_identically(model, references):
    # GIVEN a request that generated 8 tokens
    runner = Runner.create(model, block_size=4, device_blocks=64, host_blocks=0)
    seen = []
    runner.bus.subscribe(seen.extend)
    sched = Scheduler(runner)
    seq = sched.submit(Request(PROMPTS[0], max_new_tokens=12))
    for _ in range(8):
        sched.step()
    assert sched.live[seq].generated == references[0][:8]
    version = runner.cache.version(seq)
    # WHEN its last 3 tokens are rejected
    sched.rollback(seq, 3)
    # THEN the cache rolled back (version advanced), and greedy decoding regenerates the same tokens
    assert runner.cache.version(seq) == version + 3
    runner.bus.flush()
    assert any(isinstance(e, Rollback) and e.n == 3 for e in seen)
    sched.run()
    assert sched.done[seq].token_ids == references[0][:12]
    runner.close()


def test_abort_releases_the_sequence(model):
    runner = Runner.create(model, block_size=4, device_blocks=64, host_blocks=0)
    seen = []
    runner.bus.subscribe(seen.extend)
    sched = Scheduler(runner)
    seq = sched.submit(Request(PROMPTS[0], max_new_tokens=10))
    sched.step()
    gen = sched.abort(seq)
    runner.bus.flush()
    assert gen.finish_reason == "aborted" and seq not in runner.cache.seqs
    assert any(isinstance(e, SeqEnd) and e.reason == "aborted" for e in seen)
    runner.close()


def test_a_request_longer_than_the_device_tier_is_aborted(model):
    runner = Runner.create(model, block_size=4, device_blocks=4, host_blocks=0)
    sched = Scheduler(runner)
    seq = sched.submit(Request(PROMPTS[2], max_new_tokens=2))
    sched.run()
    assert sched.done[seq].finish_reason == "aborted"
    runner.close()


def test_invalid_requests_are_refused():
    with pytest.raises(ValueError, match="prompt_ids"):
        Request([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request([1], max_new_tokens=0)


def test_aborting_a_swapped_out_request_frees_its_host_blocks(model):
    # GIVEN two requests that do not fit the device together, the lower-priority one swapped out
    runner = Runner.create(model, block_size=4, device_blocks=11, host_blocks=64)
    sched = Scheduler(runner, max_batch=4)
    low = sched.submit(Request(PROMPTS[0], max_new_tokens=30, priority=0))
    sched.step()
    high = sched.submit(Request(PROMPTS[2], max_new_tokens=3, priority=5))
    sched.step()
    assert sched.state(low) == "swapped" and sched.state(high) == "running"
    assert runner.cache.stats()["tiers"]["host"]["used_blocks"] > 0
    # WHEN its client gives up, THEN its blocks leave the host tier
    sched.abort(low)
    assert runner.cache.stats()["tiers"]["host"]["used_blocks"] == 0
    runner.close()


def test_greedy_rows_take_the_first_largest_logit_a_nan_counting_as_largest():
    # GIVEN logits with ties, NaNs, infinities and a row of all -inf
    from kvdoctor.engine.serving.scheduler import _row_argmax

    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 3.0, nan], [5.0, 5.0, 1.0, 2.0], [-inf] * 4, [inf, 1.0, inf, 0.0],
                           [0.5, 2.0, -1.0, 2.0]])
    # WHEN the scheduler takes each row's greedy token THEN it is torch's argmax, row by row
    assert _row_argmax(logits) == logits.argmax(dim=-1).tolist() == [1, 0, 0, 0, 1]


def test_a_step_is_planned_by_narrow_questions_to_the_cache(model, monkeypatch):
    # GIVEN four requests on a device tier too small for all of them, a host tier to swap to, and a count of
    # the cache's queries the scheduler asks (its own calls, not the runner's)
    runner = Runner.create(model, block_size=4, device_blocks=16, host_blocks=64, disk_blocks=0)
    cache = runner.cache
    asked = Counter()

    def counted(name, method):
        def query(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename == scheduler.__file__:
                asked[name] += 1
            return method(*args, **kwargs)
        return query

    for name in ("held", "room", "stats", "seq_len", "has_sequence", "blocks_of"):
        monkeypatch.setattr(cache, name, counted(name, getattr(cache, name)))
    sched = Scheduler(runner, max_batch=4)
    for p in PROMPTS:
        sched.submit(Request(p, max_new_tokens=NEW))
    steps = preempted = 0
    while sched.has_work():
        preempted += len(sched.step().preempted)
        steps += 1
    runner.close()
    # THEN a request was preempted; each step asked what the requests hold as it planned, made room, resumed and
    # prefetched (and, after a request's blocks came back, each request after it again: at most 3 at batch 4),
    # each tier's room once (twice when it had to count what prefetches brought up); never the whole statistics
    # nor a sequence's length; whether the cache holds a sequence only as requests came and went
    assert preempted > 0
    assert asked["held"] <= 4 * steps + 3 * preempted and asked["room"] <= 2 * steps
    assert asked["stats"] == asked["seq_len"] == 0 and asked["has_sequence"] <= 3 * len(PROMPTS)


def test_held_says_what_each_sequence_holds_and_where(make_cache):
    # GIVEN a sequence of 3 blocks with one swapped to host, and one the cache does not hold
    r = make_cache(device_blocks=8, host_blocks=8)
    r.add("a", 10)
    r.cache.swap_out(r.cache.block_table("a")[:1], dst="host")
    # WHEN the scheduler's query asks for both
    held = r.cache.held(["a", "nobody"])
    # THEN the held one has its length, its two device blocks and one away; the other is left out
    assert set(held) == {"a"}
    assert (held["a"].length, held["a"].on_device, held["a"].away) == (10, 2, True)
    # AND each tier's room is its free blocks (no prefix cache gives any up here)
    assert r.cache.room() == {t: r.cache.free_blocks(t) for t in r.cache.config.tiers}
