"""The engine's parts wired together in real runs: attention importance reaches the hybrid eviction
policy, the scheduler prefetches a preempted request before it resumes, several traced caches in one
process keep their own files, and the package's public API."""

from __future__ import annotations

import pytest
import torch

from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.events import Prefetch, SwapOut


@pytest.fixture(scope="module")
def model():
    return tiny_llama().model


def _step(runner: Runner, rows) -> list[int]:
    logits = runner.forward(rows)
    runner.cache.end_step(sum(len(t) for _, t in rows))
    return logits.argmax(-1).tolist()


def _decode(runner: Runner, seq, prompt: list[int], steps: int) -> None:
    runner.cache.add_sequence(seq, prompt_len=len(prompt))
    tok = _step(runner, [(seq, prompt)])[0]
    for _ in range(steps):
        tok = _step(runner, [(seq, [tok])])[0]


def test_hybrid_policy_learns_attention_importance_and_demotes_the_least_attended_blocks(model):
    # GIVEN a hybrid policy ranking by attention importance only, and a listener so statistics are taken
    runner = Runner.create(model, block_size=4, device_blocks=6, host_blocks=16, eviction="hybrid",
                           recency_weight=0.0, distance_weight=0.0, importance_weight=1.0)
    seen: list = []
    runner.bus.subscribe(seen.extend)
    # WHEN a sequence prefills 16 tokens and decodes 3 more (5 blocks of the 6 on the device)
    _decode(runner, "a", list(range(3, 19)), steps=3)
    blocks = list(runner.cache.seqs["a"].blocks)
    importance = {b.id: runner.cache.importance.of(b) for b in blocks}
    # THEN every block it attended to carries importance
    assert len(blocks) == 5 and all(w > 0 for w in importance.values())
    assert len(set(importance.values())) > 1
    # WHEN a second sequence needs 3 blocks with 1 free: two of the first one's blocks must go to host
    runner.cache.add_sequence("b", prompt_len=12)
    _step(runner, [("b", list(range(40, 52)))])
    runner.bus.flush()
    demoted = {e.block for e in seen if isinstance(e, SwapOut) and e.src == "device"}
    # THEN the demoted ones are the two least attended
    assert demoted == set(sorted(importance, key=importance.get)[:2])
    runner.close()


def test_without_the_hybrid_policy_no_importance_is_collected(model):
    runner = Runner.create(model, block_size=4, device_blocks=8, host_blocks=8)
    runner.bus.subscribe(lambda evs: None)
    _decode(runner, "a", list(range(3, 19)), steps=2)
    assert not runner.cache.importance.mass
    runner.close()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]


def _serve(model, **config):
    """Four requests of two priorities through a device tier too small for all of them."""
    runner = Runner.create(model, block_size=4, device_blocks=16, host_blocks=6, disk_blocks=64, **config)
    seen: list = []
    runner.bus.subscribe(seen.extend)
    sched = Scheduler(runner, max_batch=4)
    seqs = [sched.submit(Request(p, max_new_tokens=20, priority=pr)) for p, pr in zip(PROMPTS, (0, 1, 0, 1))]
    done = sched.run()
    runner.bus.flush()
    stats = runner.cache.stats()
    runner.close()
    return [done[s].token_ids for s in seqs], seen, stats


def test_scheduler_prefetches_a_preempted_request_before_it_resumes(model):
    # GIVEN the same preempting workload with prefetch off and on (the default depth)
    plain, plain_seen, plain_stats = _serve(model, prefetch_depth=0)
    tokens, seen, stats = _serve(model)
    # THEN requests were preempted, and with prefetch their blocks came up ahead of use
    assert any(isinstance(e, SwapOut) for e in seen)
    prefetches = [e for e in seen if isinstance(e, Prefetch)]
    assert prefetches and all(e.dst == "device" and len(e.blocks) <= 4 for e in prefetches)
    assert stats["prefetch_hits"] > 0 and stats["prefetch_hit_rate"] > 0
    assert not any(isinstance(e, Prefetch) for e in plain_seen) and plain_stats["prefetch_hits"] == 0
    # AND fewer blocks were copied in while a step waited for them
    assert stats["prefetch_misses"] < plain_stats["prefetch_misses"]
    # AND the tokens are those of the run without prefetch
    assert tokens == plain


def test_several_traced_caches_in_one_process_write_numbered_files(tmp_path, monkeypatch):
    from kvdoctor.engine.kv.cache import PagedKVCache
    from kvdoctor.trace import TraceReader

    from engine_support import tiny_config

    # GIVEN tracing switched on by the environment, and three caches built in one process
    path = tmp_path / "run.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    caches = [PagedKVCache(tiny_config(disk_dir=str(tmp_path))) for _ in range(3)]
    # WHEN each records its own sequence
    for i, cache in enumerate(caches):
        cache.add_sequence(f"seq-{i}", 1)
        cache.end_step(0)
    for cache in caches:
        cache.close()
    # THEN the first wrote the named file and the others numbered files beside it, none clobbered
    files = [path, tmp_path / "run.2.kvtrace", tmp_path / "run.3.kvtrace"]
    assert sorted(p.name for p in tmp_path.glob("*.kvtrace")) == sorted(f.name for f in files)
    for i, f in enumerate(files):
        reader = TraceReader(f)
        seqs = [e.seq for e in reader if type(e).__struct_config__.tag == "seq_start"]
        assert seqs == [f"seq-{i}"] and not reader.truncated


def test_package_names_its_public_api_and_imports_without_torch():
    import subprocess
    import sys

    # GIVEN a fresh interpreter WHEN it imports the engine package THEN torch is not loaded yet,
    # and every public name then resolves to its home module's object
    code = (
        "import sys, importlib, kvdoctor.engine as e\n"
        "assert 'torch' not in sys.modules, 'torch loaded at package import'\n"
        "assert set(e.__all__) <= set(dir(e))\n"
        "for name in e.__all__:\n"
        "    assert getattr(e, name) is not None, name\n"
        "assert e.Runner is importlib.import_module('kvdoctor.engine.serving.runner').Runner\n"
        "assert e.errors.OutOfBlocks is e.OutOfBlocks\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    import kvdoctor.engine as engine

    assert {"PagedKVCache", "EngineConfig", "Runner", "Scheduler", "Request", "SamplingParams", "EngineCache",
            "load_model", "errors"} <= set(engine.__all__)
