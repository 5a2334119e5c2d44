"""kvdoctor's vLLM plugin on real vLLM: a clean run is silent, and bugs of vLLM's block manager,
reproduced by patching vLLM in-process, are each caught naming the vLLM request and block.

One engine (SmolLM2, 24 blocks of 32 tokens, prefix caching) serves every test in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler is here to patch); each test attaches a
fresh tracer to an emptied prefix cache and detaches it after. Run with ``./kvd test-vllm``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# An explicit KV space: without it vLLM's CPU worker asks for gpu_memory_utilization of the NUMA node less this
# process's RSS, which two engines in one process exceed on a node of 10 GiB (a negative request, refused).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvdoctor.checks import make_suite  # noqa: E402
from kvdoctor.events import SeqEnd, SeqStart, Share, Weights  # noqa: E402
from kvdoctor.integrations.vllm import PREFIX_CACHE, VllmTracer  # noqa: E402
from kvdoctor.trace import TraceReader  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = ("You are a careful assistant for people who run language models in production. You answer in two or "
          "three short sentences, name the component you mean, and say plainly when you are unsure. ") * 2
QUESTIONS = ["What is a KV cache?", "Why do long prompts use more memory?", "What is prefix caching?",
             "When should a server preempt a request?", "What is continuous batching?", "Why quantize the cache?",
             "What is a stale cache version?", "What is speculative decoding?"]


@pytest.fixture(scope="module")
def llm():
    from kvdoctor.engine.model.model import convert_embedded

    engine = LLM(model=str(convert_embedded()), dtype="float32", enforce_eager=True, max_model_len=512,
                 block_size=32, num_gpu_blocks_override=24, enable_prefix_caching=True, max_num_seqs=8, seed=0,
                 gpu_memory_utilization=0.2)
    yield engine
    del engine


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _prompts(llm, n, *, system=SYSTEM):
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                    tokenize=False, add_generation_prompt=True) for q in (QUESTIONS * 2)[:n]]


def _run(llm, prompts, *, max_tokens=24, abort=(), abort_at=4):
    """Serve ``prompts`` step by step (request i is ``r{i}``), aborting ``abort`` after ``abort_at`` steps."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == abort_at and abort:
            engine.abort_request(list(abort))


@pytest.fixture
def traced(llm, tmp_path):
    """A tracer on an emptied prefix cache; yields the findings function to call after the run."""
    sched = _scheduler(llm)
    assert sched.kv_cache_manager.block_pool.reset_prefix_cache(), "a previous test left blocks held"
    path = tmp_path / "vllm.kvtrace"
    tracer = VllmTracer(sched, str(path), engine="vllm test")
    sched._kvdoctor = tracer  # where the plugin keeps it: the engine core's utilities find it there

    def findings():
        tracer.detach()
        suite = make_suite()
        with_findings = suite.observe_many(TraceReader(path))
        return with_findings + suite.finish(), list(TraceReader(path))

    yield findings
    if tracer._wrapped:
        tracer.detach()
    vars(sched).pop("_kvdoctor", None)


def _request_id(seq: str) -> str:
    """vLLM adds a suffix to the ids callers give (``r3`` becomes ``r3-1a2b…``)."""
    return seq.rsplit("-", 1)[0]


def test_a_clean_run_with_prefix_hits_preemption_and_aborts_gives_no_finding(llm, traced):
    # GIVEN twelve requests sharing a system prompt on 24 blocks, two aborted mid-way
    _run(llm, _prompts(llm, 12), max_tokens=40, abort=["r1", "r3"])
    findings, events = traced()
    # THEN the trace shows hits and aborts, and no check finds anything
    assert any(type(e) is Share and e.seq != PREFIX_CACHE for e in events), "no prefix hit happened"
    ends = [e for e in events if type(e) is SeqEnd]
    assert sum(1 for e in ends if e.reason == "aborted") == 2
    assert len(ends) == sum(1 for e in events if type(e) is SeqStart) == 12
    assert findings == []


def test_a_block_not_freed_on_abort_is_a_leak_naming_request_and_block(llm, traced, monkeypatch):
    # GIVEN vLLM's free path forgets the tail block of an aborted request
    sched, leaked = _scheduler(llm), []
    original = SingleTypeKVCacheManager.free

    def free(self, request_id):
        req = sched.requests.get(request_id)
        if req is None or req.status != RequestStatus.FINISHED_ABORTED or leaked:
            return original(self, request_id)
        blocks = self.pop_blocks_for_free(request_id)
        leaked.append((request_id, blocks.pop()))
        self.block_pool.free_blocks(reversed(blocks))

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free)
    _run(llm, _prompts(llm, 4), abort=["r2"])
    findings, _ = traced()
    monkeypatch.undo()
    request_id, block = leaked[0]
    sched.kv_cache_manager.block_pool.free_blocks([block])  # repair the engine for the next tests
    # THEN the leak check names the aborted request and the forgotten block
    leaks = [f for f in findings if f.check == "leak" and f.rule == "unreachable"]
    assert [(f.seq, f.block) for f in leaks] == [(request_id, block.block_id)], findings


def test_a_reference_kept_on_preemption_is_a_leak_naming_request_and_block(llm, traced, monkeypatch):
    # GIVEN vLLM's preemption path drops every reference of the preempted request but one
    sched, kept = _scheduler(llm), []
    original = SingleTypeKVCacheManager.free

    def free(self, request_id):
        req = sched.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING or kept:  # RUNNING here: being preempted
            return original(self, request_id)
        blocks = self.pop_blocks_for_free(request_id)
        kept.append((request_id, blocks.pop()))
        self.block_pool.free_blocks(reversed(blocks))

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free)
    _run(llm, _prompts(llm, 12), max_tokens=40)
    findings, _ = traced()
    monkeypatch.undo()
    assert kept, "the workload did not preempt: the pool is too large for this test"
    request_id, block = kept[0]
    sched.kv_cache_manager.block_pool.free_blocks([block])
    leaks = [f for f in findings if f.check == "leak" and f.rule == "unreachable"]
    assert (request_id, block.block_id) in [(f.seq, f.block) for f in leaks], findings


def test_a_hash_that_leaves_out_the_cache_salt_serves_another_tenants_blocks(llm, traced, monkeypatch):
    # GIVEN vLLM's block hash forgets the cache salt, and two tenants send the same prompt
    original = kv_cache_utils.generate_block_hash_extra_keys

    def without_salt(request, *args):
        keys, mm_idx = original(request, *args)
        keys = tuple(k for k in keys or () if not (isinstance(k, tuple) and k[:1] == ("cache_salt",)))
        return keys or None, mm_idx

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", without_salt)
    prompt = _prompts(llm, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt": prompt, "cache_salt": "tenant-a"}], params, use_tqdm=False)
    llm.generate([{"prompt": prompt, "cache_salt": "tenant-b"}], params, use_tqdm=False)
    findings, _ = traced()
    # THEN the prefix check names tenant b's request and the blocks it was served
    mismatches = [f for f in findings if f.rule == "hash-mismatch"]
    assert mismatches and all(f.check == "prefix" for f in mismatches), findings
    assert {f.evidence["registered_by"] for f in mismatches} == {PREFIX_CACHE}
    assert len({f.seq for f in mismatches}) == 1 and all(isinstance(f.block, int) for f in mismatches)


def _scaled_keys(factor):
    """An in-place weight update as RL frameworks make one: layer 0's input norm scaled, so every K and V
    changes (vLLM's CPU backend packs the linear layers' weights into oneDNN handles and empties their
    parameters, so an edit there would change nothing)."""
    def update(model):
        for name, p in model.named_parameters():
            if name.endswith("layers.0.input_layernorm.weight"):
                p.data.mul_(factor)
                return name
    return update


@pytest.fixture
def weights_watched():
    """The engine core's utilities wrapped (as the plugin does where it builds the scheduler)."""
    from vllm.v1.engine.core import EngineCore

    from kvdoctor.integrations.vllm_weights import patch_engine_core

    patch_engine_core(EngineCore)


@pytest.mark.parametrize("reset", [False, True])
def test_a_prefix_hit_after_an_in_place_weight_update_without_a_reset_is_stale(llm, traced, weights_watched, reset):
    # GIVEN a prompt generated once (its blocks in the prefix cache), then the weights updated in place
    prompt = _prompts(llm, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.apply_model(lambda model: sum(1 for _ in model.parameters()))  # reads only: no new version
    changed = llm.apply_model(_scaled_keys(2.0))
    assert any(changed), "no key projection found to update"
    if reset:
        assert llm.reset_prefix_cache()
    # WHEN the same prompt comes again
    try:
        llm.generate([prompt], params, use_tqdm=False)
        findings, events = traced()
    finally:
        llm.apply_model(_scaled_keys(0.5))  # exact in float32: the shared engine gets its weights back
    weights = [e for e in events if type(e) is Weights]
    # THEN one weights event marks the update (not the read-only call), and without a reset the hit is stale
    assert [(w.version, w.cause) for w in weights] == [(1, "update")], (weights, findings)
    assert "apply_model" in weights[0].detail
    if reset:
        assert findings == [], findings
        return
    stale = [f for f in findings if f.rule == "stale-prefix-hit"]
    assert stale and {f.check for f in findings} == {"weights"}, findings
    assert "computed under weights v0; weights are v1" in stale[0].message and isinstance(stale[0].block, int)


# After the tests that need a sound pool: this one leaves the engine's pool corrupted.
def test_a_shared_block_freed_twice_is_handed_out_while_its_reader_runs(llm, traced, monkeypatch):
    # GIVEN vLLM's free path lists a shared prefix block twice when one of its holders ends,
    # dropping the other holder's reference too
    sched, hit = _scheduler(llm), []
    original = SingleTypeKVCacheManager.free

    def free(self, request_id):
        blocks = self.pop_blocks_for_free(request_id)
        shared = [b for b in blocks if not b.is_null and b.ref_cnt > 1]
        if _request_id(request_id) == "brief" and shared and not hit:
            hit.append(shared[0].block_id)
            blocks.append(shared[0])
        self.block_pool.free_blocks(reversed(blocks))

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free)
    prompts = _prompts(llm, 8)
    engine = llm.llm_engine
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("warm", prompts[0], short)  # fills the prefix cache
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("reader", prompts[1], long)  # holds the shared prefix blocks for a while
    engine.add_request("brief", prompts[2], short)  # shares them too, and ends first: the bug fires
    other = _prompts(llm, 6, system="Answer in one word. " * 30)
    for i, p in enumerate(other):  # new prompts that need fresh blocks: the pool hands the block out again
        engine.add_request(f"other{i}", p, short)
    steps = 0
    while engine.has_unfinished_requests() and steps < 40:  # the corrupted pool is abandoned after the finding
        engine.step()
        steps += 1
    findings, _ = traced()
    monkeypatch.undo()
    assert hit, "no shared block was freed"
    # THEN the reader is named reading a block it no longer owns (or one the pool freed under it)
    named = [f for f in findings if f.block == hit[0] and f.rule in ("read-not-owned", "read-freed")]
    assert named and _request_id(str(named[0].seq)) == "reader", findings


# Last in this module: this test builds a second engine, and when it is collected vLLM tears down its
# process-wide parallel state, which the module's shared engine (the `llm` fixture) still needs.
def test_vllms_own_kv_events_through_the_bridge_give_no_finding_on_a_clean_run(tmp_path):
    # GIVEN kvdoctor check subscribed to a vLLM engine publishing its KV events over ZMQ
    import json
    import subprocess
    import sys

    from vllm.config import KVEventsConfig

    from kvdoctor.engine.model.model import convert_embedded

    endpoint = f"ipc://{tmp_path}/kv-events"  # vLLM binds an ipc:// (or tcp://*:PORT) endpoint and kvdoctor connects
    check = subprocess.Popen([sys.executable, "-m", "kvdoctor.cli", "check", "--vllm-events", endpoint,
                              "--idle-exit", "8", "--format", "json", "--fail-on", "info"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        engine = LLM(model=str(convert_embedded()), dtype="float32", enforce_eager=True, max_model_len=512,
                     block_size=32, num_gpu_blocks_override=24, enable_prefix_caching=True, max_num_seqs=8, seed=0,
                     gpu_memory_utilization=0.2,
                     kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint=endpoint, topic="kv"))
        # WHEN it serves requests that share a prefix on a pool small enough to evict cached blocks
        _run(engine, _prompts(engine, 12), max_tokens=40)
        out, err = check.communicate(timeout=120)
    finally:
        check.kill()
    # THEN the bridge saw stored and removed blocks, and found nothing
    report = json.loads(out)
    assert check.returncode == 0, err
    assert report["findings"] == [] and report["summary"]["events"] > 12, report["summary"]
