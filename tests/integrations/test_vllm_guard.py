"""The vLLM plugin never harms vLLM: every wrapped method runs exactly as called, and a failure of
kvdoctor's own bookkeeping is one ``observer_error`` in the trace, not an exception in vLLM.

One workload drives vLLM's scheduler without a model (``vllm_harness``) through the paths that call
every wrapped method: prefix hits and evictions, copy-free preemption, an abort, a KV connector that
loads from outside in the background and keeps a finished request's blocks while it sends them, a
prefix-cache reset.
Its schedules, outputs and final pool state are the reference; the same workload under the tracer,
with every wrapped method called by keyword only, or with the bookkeeping of one method failing,
must give the same. Run with ``./kvd test-vllm``.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvdoctor.checks import make_suite  # noqa: E402
from kvdoctor.events import ObserverError  # noqa: E402
from kvdoctor.integrations import guard as guard_module  # noqa: E402
from kvdoctor.trace import TraceReader  # noqa: E402

from vllm_harness import make_harness  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
SYSTEM = list(range(1, 3 * BS + 1))


def _workload(h) -> list:
    """Every path the tracer wraps; returns what vLLM did, step by step, and its pool at the end."""
    seen: list = []
    h.connector.external["remote"] = 2 * BS
    h.connector.load_async.add("remote")  # loaded in the background: the request waits for remote K/V
    h.connector.delay_free.add("sender")
    h.request("sender", SYSTEM + [200] * 5, max_tokens=3)
    for i in range(6):  # more than the pool holds at once: hits on the shared prefix, then preemption
        h.request(f"r{i}", SYSTEM + [300 + i] * (BS + 3), max_tokens=20)
    h.request("remote", [700] * (3 * BS), max_tokens=4)

    def step() -> None:
        out = h.step()
        seen.append((sorted(out.num_scheduled_tokens.items()),
                     [(d.req_id, d.block_ids) for d in out.scheduled_new_reqs],
                     sorted(out.preempted_req_ids or ()), sorted(out.finished_req_ids)))

    loaded: list[int] = []
    for n in range(400):
        remote = h.scheduler.requests.get("remote")
        if remote is not None and remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not loaded:
            h.recving.add("remote")  # its load finishes in the step that follows
            loaded.append(n)
        if n == 3:
            h.abort("r5")
        if n == 6:
            h.sending.add("sender")
        if not h.scheduler.has_requests():
            break
        step()
    pool = h.scheduler.kv_cache_manager.block_pool
    seen.append(("reset", pool.reset_prefix_cache()))
    seen.append(("pool", pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks]))
    seen.append(("outputs", [sorted((k, sorted(o.request_id for o in v.outputs)) for k, v in step_out.items())
                             for step_out in h.outputs]))
    return seen


def _harness(path, **kwargs):
    return make_harness(path, num_blocks=16, block_size=BS, connector=True, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The workload on vLLM alone: the tracer taken off before anything ran."""
    h = _harness(tmp_path_factory.mktemp("ref") / "ref.kvtrace")
    h.tracer.detach()
    return _workload(h)


def _wrapped_parts(h) -> list[str]:
    return [f"{type(obj).__name__}.{name}" for obj, name in h.tracer._wrapped]


def _by_keyword(h) -> set[str]:
    """Every wrapped method called with keyword arguments only, as some of vLLM's paths call them."""
    called: set[str] = set()
    for obj, name in h.tracer._wrapped:
        traced = getattr(obj, name)
        params = inspect.signature(traced.__wrapped__).parameters

        def keywords(*args, _traced=traced, _params=params, _part=f"{type(obj).__name__}.{name}", **kwargs):
            called.add(_part)
            kwargs.update(zip(_params, args))
            return _traced(**kwargs)

        setattr(obj, name, keywords)
    return called


def test_every_wrapped_method_called_by_keyword_runs_as_vllm_alone_and_is_clean(reference, tmp_path):
    # GIVEN the traced scheduler, each wrapped method called with keyword arguments only
    h = _harness(tmp_path / "kw.kvtrace")
    parts = _wrapped_parts(h)
    called = _by_keyword(h)
    # WHEN the workload runs
    seen = _workload(h)
    findings, _ = h.findings()
    # THEN vLLM did exactly what it does alone, every wrapped method was exercised (but those only hybrid
    # models and overlapping batches reach, called below), and nothing was found
    assert seen == reference
    assert called == set(parts) - set(BEYOND_THE_WORKLOAD), f"not exercised: {set(parts) - called}"
    assert findings == [], [f.message for f in findings[:5]]


# Reached only by hybrid (Mamba) models' partial hits and by deferred frees under overlapping batches
BEYOND_THE_WORKLOAD = ("BlockPool.move_block_hashes", "KVCacheManager.pop_blocks_for_free")


def _after_a_few_steps(path, *, traced: bool):
    h = _harness(path)
    if not traced:
        h.tracer.detach()
    h.request("a", SYSTEM + [5] * 3, max_tokens=8)
    for _ in range(3):
        h.step()
    return h


def test_the_methods_the_workload_does_not_reach_run_as_vllm_alone_when_called_by_keyword(tmp_path):
    # GIVEN the same scheduler state traced and untraced
    results = []
    for traced in (False, True):
        h = _after_a_few_steps(tmp_path / f"{traced}.kvtrace", traced=traced)
        pool, manager = h.scheduler.kv_cache_manager.block_pool, h.scheduler.kv_cache_manager
        # WHEN vLLM moves a cached block's hash to a copy, and takes a request's blocks back to free later,
        # both by keyword
        src = next(b for b in pool.blocks if b.block_hash is not None)
        dst = pool.get_new_blocks(1)[0]
        pool.move_block_hashes(src_block=src, dst_block=dst)
        popped = manager.pop_blocks_for_free(request=h.scheduler.requests["a"])
        pool.free_blocks(ordered_blocks=reversed(popped))
        results.append((src.block_id, src.block_hash, dst.block_id, dst.block_hash, [b.block_id for b in popped],
                        pool.get_num_free_blocks()))
        if traced:
            h.tracer.detach()
            assert not [e for e in TraceReader(h.path) if type(e) is ObserverError]
    # THEN vLLM's results are the same with and without the tracer
    assert results[0] == results[1]


def _failing(monkeypatch, part: str) -> None:
    """The bookkeeping kvdoctor runs around ``part`` raises, as a renamed vLLM attribute would."""
    wrap = guard_module.Guard.wrap

    def wrap_failing(self, original, name, *, before=None, after=None, restore=None):
        if name == part:
            def after(call, result, state):
                raise KeyError("injected into kvdoctor's bookkeeping")
        return wrap(self, original, name, before=before, after=after, restore=restore)

    monkeypatch.setattr(guard_module.Guard, "wrap", wrap_failing)


PARTS = ["BlockPool.get_new_blocks", "BlockPool.touch", "BlockPool.free_blocks", "BlockPool.cache_full_blocks",
         "BlockPool._remove_cached_block_hashes", "BlockPool.reset_prefix_cache", "KVCacheManager.allocate_slots",
         "KVCacheManager.free", "KVCacheManager.remove_skipped_blocks", "Scheduler.schedule",
         "Scheduler.update_from_output", "Scheduler.add_request", "Scheduler._free_request",
         "Scheduler._free_blocks", "Scheduler._preempt_request", "Scheduler._update_waiting_for_remote_kv"]


@pytest.mark.parametrize("part", PARTS)
def test_a_failure_in_the_bookkeeping_of_any_method_is_one_observer_error_and_vllm_goes_on(
        reference, tmp_path, monkeypatch, part):
    # GIVEN kvdoctor's bookkeeping around one of vLLM's methods fails
    _failing(monkeypatch, part)
    h = _harness(tmp_path / "fail.kvtrace")
    assert part in _wrapped_parts(h)
    # WHEN the workload runs
    seen = _workload(h)
    h.tracer.detach()
    events = list(TraceReader(h.path))
    suite = make_suite()
    findings = suite.observe_many(events) + suite.finish()
    # THEN vLLM did exactly what it does alone; the trace ends with one observer_error naming the method,
    # and the only finding is that kvdoctor lost track (nothing after it judged)
    assert seen == reference
    errors = [e for e in events if type(e) is ObserverError]
    assert len(errors) == 1 and errors[0] is events[-2] and type(events[-1]).__name__ == "TraceEnd"
    assert errors[0].part == part and errors[0].error == "KeyError" and errors[0].stopped
    assert errors[0].where and errors[0].where.startswith("kvdoctor/")
    assert [(f.check, f.rule) for f in findings] == [("observer", "lost-track")]
    assert "kvdoctor lost track of vllm in " + part in findings[0].message
