"""Each deliberate engine fault, switched on in the real engine, is caught by its check,
naming the right sequence and block (or layer) — and the same run without it is clean."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from test_engine_soak import append, tiny_cache  # noqa: E402

from kvdoctor.checks import make_suite  # noqa: E402
from kvdoctor.engine.model.model import tiny_llama  # noqa: E402
from kvdoctor.engine.serving.runner import Runner, SamplingParams  # noqa: E402
from kvdoctor.engine.serving.scheduler import Request, Scheduler  # noqa: E402
from kvdoctor.session import Session  # noqa: E402


def checked(cache):
    suite = make_suite()
    cache.bus.subscribe(suite.observe_many)
    return suite


def finish(cache, suite):
    cache.close()
    suite.finish()
    return suite.findings


@pytest.mark.parametrize("fault", [None, "leak-swapped"])
def test_leak_swapped_blocks_forgotten_at_seq_end(fault):
    # GIVEN a request with three blocks, two of them swapped out (one on to disk)
    cache = tiny_cache(fault)
    suite = checked(cache)
    cache.add_sequence("req-A", prompt_len=12)
    append(cache, "req-A", 12)
    b0, b1, b2 = cache.block_table("req-A")
    cache.swap_out([b0, b1], dst="host")
    cache.swap_out([b1], dst="disk")
    cache.end_step(12)
    # WHEN it ends
    cache.remove_sequence("req-A")
    cache.end_step(0)
    findings = finish(cache, suite)
    # THEN with the fault exactly the two swapped blocks are reported, naming the request
    if fault is None:
        assert findings == []
        return
    assert sorted((f.rule, f.block, f.seq, f.evidence["tier"]) for f in findings) == [
        ("unreachable-swapped", b0, "req-A", "host"), ("unreachable-swapped", b1, "req-A", "disk")]


@pytest.mark.parametrize("fault", [None, "stale-version"])
def test_stale_version_swap_in_serves_an_old_copy(fault):
    cache = tiny_cache(fault)
    suite = checked(cache)
    cache.add_sequence("req-B", prompt_len=6)
    append(cache, "req-B", 6)  # block 0 full, block 1 holds 2 tokens
    tail = cache.block_table("req-B")[-1]
    cache.swap_out([tail], dst="host")
    cache.ensure_resident(["req-B"])  # back on device; the fault keeps the host copy around
    append(cache, "req-B", 1)  # a newer write into the same block
    cache.swap_out([tail], dst="host")
    cache.ensure_resident(["req-B"])
    cache.emit_read("req-B", layer=0)
    cache.end_step(1)
    findings = finish(cache, suite)
    if fault is None:
        assert findings == []
        return
    # the stale swap-in is the finding; the read of the copy it brought back is counted in its cascade
    (f,) = [f for f in findings if f.check == "stale"]
    assert f.rule == "stale-swap-in" and "stale/stale-read" in f.evidence["cascade"]["rules"]
    assert (f.block, f.seq) == (tail, "req-B")
    assert f.evidence["seen_version"] < f.evidence["last_write_version"] == 7


@pytest.mark.parametrize("fault", [None, "batch-misalign"])
def test_batch_misalign_second_row_writes_into_first_rows_block(fault):
    cache = tiny_cache(fault)
    suite = checked(cache)
    for seq in ("row-0", "row-1"):
        cache.add_sequence(seq, prompt_len=3)
        append(cache, seq, 3)
    cache.end_step(6)
    first_tail = cache.block_table("row-0")[-1]
    # one decode step of a batch of two
    slots = [cache.reserve(seq, 1) for seq in ("row-0", "row-1")]
    for layer in range(2):
        for s in slots:
            kv = torch.randn(1, 1, 4)
            cache.store(layer, s, kv, kv)
    for seq in ("row-0", "row-1"):
        cache.commit(seq)
    cache.end_step(2)
    findings = finish(cache, suite)
    if fault is None:
        assert findings == []
        return
    assert [(f.rule, f.seq, f.block) for f in findings] == [("write-not-owned", "row-1", first_tail)]
    assert findings[0].evidence["owners"] == ["row-0"]


def serve(fault: str | None, steps: int, *, greedy: bool = False, seed: int = 0, abort_rate: float = 0.5) -> Session:
    """The real model path: a tiny Llama, continuous batching through a small device tier that
    forces preemption by swap, aborts of swapped-out requests, rollbacks."""
    lm = tiny_llama(num_layers=2, max_position_embeddings=512)
    runner = Runner.create(lm.model, block_size=4, device_blocks=14, host_blocks=48, disk_blocks=0, fault=fault)
    session = Session.on_bus(runner.bus)
    sched = Scheduler(runner, max_batch=6)
    rng = random.Random(seed)
    for _ in range(steps):
        while len(sched.live) < 6:
            ids = [rng.randrange(3, 128) for _ in range(rng.randint(2, 16))]
            sampling = SamplingParams(greedy=True) if greedy else SamplingParams(
                greedy=False, temperature=0.8, seed=rng.randrange(1000))
            sched.submit(Request(ids, max_new_tokens=rng.randint(4, 16), ignore_eos=True, sampling=sampling))
        sched.step()
        swapped = [s for s, live in sched.live.items() if live.state == "swapped"]
        if swapped and rng.random() < abort_rate:
            sched.abort(rng.choice(swapped))
        running = [s for s, live in sched.live.items() if live.state == "running" and len(live.generated) > 2]
        if running and rng.random() < 0.2:
            sched.rollback(rng.choice(running), 1)
    runner.close()
    session.close()
    return session


def owned_by(f, seq) -> bool:
    """The finding's block was allocated to or shared with ``seq``, as its own history shows."""
    return any(e.get("seq") == seq and e["kind"] in ("alloc", "share") for e in f.evidence["history"])


def test_real_model_run_without_faults_is_clean():
    session = serve(None, 40)
    assert [f.message for f in session.findings] == []
    assert session.num_events > 500


@pytest.mark.parametrize("fault, rule", [
    ("leak-swapped", "leak/unreachable-swapped"),
    ("stale-version", "stale/stale-swap-in"),
    ("batch-misalign", "batch/write-not-owned"),
    ("attention-nan", "attention/nonfinite"),
])
def test_each_fault_is_caught_on_the_real_model_path(fault, rule):
    # greedy: a NaN in the scores reaches the logits, and sampling would refuse them;
    # stale copies need blocks to make two round trips, so no request is abandoned there
    session = serve(fault, 40, greedy=fault == "attention-nan", abort_rate=0.0 if fault == "stale-version" else 0.5)
    hits = [f for f in session.findings if f"{f.check}/{f.rule}" == rule]
    assert hits, [f"{f.check}/{f.rule}" for f in session.findings]
    for f in hits:
        assert f.seq is not None
        if fault == "attention-nan":
            assert f.layer == 1  # the middle layer of two
        elif fault == "batch-misalign":
            assert not owned_by(f, f.seq) and f.evidence["owners"]  # wrote into another's block
        else:
            assert owned_by(f, f.seq)
