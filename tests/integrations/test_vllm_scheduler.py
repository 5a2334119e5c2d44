"""kvdoctor's vLLM tracer on every path of vLLM v1's scheduler, driven without a model.

Each test builds a scheduler on a few blocks (``vllm_harness``: no weights, no worker, CPU only),
feeds it requests and synthetic model outputs the way vLLM's own tests/v1/core do, and judges the
trace with every check: a clean run of each path gives no finding of any severity, and each class
of block-manager bug, patched into vLLM in-process, is named. Run with ``./kvd test-vllm``.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvdoctor.events import Alloc, Batch, Evict, Read, Rollback, SeqEnd, Share  # noqa: E402
from kvdoctor.integrations.vllm import PREFIX_CACHE  # noqa: E402

from vllm_harness import make_harness  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
SYSTEM = list(range(1, 3 * BS + 1))  # three full blocks every request below shares


def _prompt(i: int, n: int = BS + 5, *, prefix: list[int] = SYSTEM) -> list[int]:
    return prefix + [100 + i] * n


@pytest.fixture
def harness(tmp_path):
    """A traced scheduler factory; each call writes its own trace under ``tmp_path``."""
    made = []

    def make(**kwargs):
        h = make_harness(tmp_path / f"sched{len(made)}.kvtrace", block_size=BS, **kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _clean(h) -> list:
    """Judge ``h``'s trace; asserts no finding of any severity and returns its events."""
    findings, events = h.findings()
    assert findings == [], f"{len(findings)} findings, first: " + "\n".join(
        f"{f.severity} {f.check}/{f.rule}: {f.message}" for f in findings[:6])
    return events


def _ends(events) -> dict:
    return {e.seq: e.reason for e in events if type(e) is SeqEnd}


def _first_positions(events) -> dict:
    """Where each request's first computed row started (past its cached and loaded tokens)."""
    first: dict = {}
    for b in events:
        if type(b) is Batch:
            for row, pos in zip(b.rows, b.positions):
                first.setdefault(row, pos)
    return first


def _hits(events) -> list:
    return [e for e in events if type(e) is Share and e.seq != PREFIX_CACHE]


# ---- clean runs: every path, no finding -------------------------------------------------


def test_chunked_prefill_of_a_long_prompt_is_clean(harness):
    # GIVEN a prompt of ten blocks and a token budget of two blocks per step
    h = harness(max_num_batched_tokens=2 * BS)
    h.request("long", list(range(10 * BS)), max_tokens=6)
    h.request("short", _prompt(1), max_tokens=6)
    h.run()
    events = _clean(h)
    # THEN the long prompt was computed in chunks, each starting where the last one ended
    rows = [(b.positions[b.rows.index("long")], b.n[b.rows.index("long")])
            for b in events if type(b) is Batch and "long" in b.rows]
    assert len([n for _, n in rows if n > 1]) >= 5, rows
    assert all(pos == prev + n for (prev, n), (pos, _) in zip(rows, rows[1:])), rows
    assert _ends(events) == {"long": "finished", "short": "finished"}


def test_prefix_hits_and_evictions_of_the_prefix_cache_are_clean(harness):
    # GIVEN a pool of 12 blocks: one request warms the cache with the shared prefix
    h = harness(num_blocks=12)
    h.request("warm", _prompt(0), max_tokens=4)
    h.run()
    # WHEN a second request hits it, then unrelated prompts need every block, then the prefix comes back
    h.request("hit", _prompt(1), max_tokens=4)
    h.run()
    for i in range(3):
        h.request(f"other{i}", _prompt(i, n=2 * BS, prefix=[900 + i] * (2 * BS)), max_tokens=4)
    h.run()
    h.request("again", _prompt(2), max_tokens=4)
    h.run()
    events = _clean(h)
    # THEN the trace shows the hit and the evictions, and no check finds anything
    assert {e.seq for e in _hits(events)} >= {"hit"}
    assert any(type(e) is Evict for e in events), "nothing was evicted: the pool is too large"
    # AND every read names the positions it attends to, from 0 through the row's last token: the hit's
    # read spans the blocks another request wrote, judged by slots/unwritten-read (silent above)
    rows = {(row, pos + n) for b in events if type(b) is Batch for row, pos, n in zip(b.rows, b.positions, b.n)}
    reads = [e for e in events if type(e) is Read]
    assert reads and {(e.seq, tuple(e.span)) for e in reads} == {(row, (0, end)) for row, end in rows}


def test_a_sliding_window_that_drops_blocks_is_clean_and_reads_span_the_window(harness):
    # GIVEN a sliding window of 40 tokens over blocks of 16, and a prompt and output far longer
    h = harness(sliding_window=40, max_num_batched_tokens=2 * BS)
    h.request("long", list(range(1000, 1000 + 6 * BS)), max_tokens=3 * BS)
    h.run()
    events = _clean(h)
    # THEN vLLM dropped the blocks behind the window, and each read's span starts at the first block it kept
    reads = [e for e in events if type(e) is Read]
    assert reads[-1].span[0] > 0 and len(reads[-1].blocks) < reads[-1].span[1] // BS
    assert all(e.span[0] % BS == 0 and len(e.blocks) == -(-e.span[1] // BS) - e.span[0] // BS for e in reads)


def test_preemption_and_resumption_are_clean(harness):
    # GIVEN six requests that together need more blocks than the pool holds
    h = harness(num_blocks=14, max_num_batched_tokens=4 * BS)
    for i in range(6):
        h.request(f"r{i}", _prompt(i), max_tokens=3 * BS)
    h.run(max_steps=400)
    events = _clean(h)
    # THEN vLLM preempted and resumed requests, and every one finished
    assert sum(r.num_preemptions for r in h.added) > 0, "nothing was preempted: the pool is too large"
    assert set(_ends(events).values()) == {"finished"} and len(_ends(events)) == 6


def test_aborts_while_waiting_running_and_preempted_are_clean(harness):
    # GIVEN a small pool, one request slot more than the running limit, and long outputs
    h = harness(num_blocks=14, max_num_batched_tokens=4 * BS, max_num_seqs=4)
    for i in range(6):
        h.request(f"r{i}", _prompt(i), max_tokens=3 * BS)
    states = {}
    # WHEN one request of each state is aborted as soon as one is in it
    wanted = {RequestStatus.WAITING: "waiting", RequestStatus.RUNNING: "running",
              RequestStatus.PREEMPTED: "preempted"}

    def abort_one_per_state() -> bool:
        for r in list(h.scheduler.requests.values()):
            name = wanted.get(r.status)
            if name and name not in states and (name != "running" or r.num_computed_tokens > 0):
                states[name] = r.request_id
                h.abort(r.request_id)
        return not h.scheduler.has_requests()

    h.run(until=abort_one_per_state, max_steps=400)
    events = _clean(h)
    # THEN each state saw an abort, and each aborted request ended as aborted
    assert set(states) == set(wanted.values()), states
    assert all(_ends(events)[r] == "aborted" for r in states.values())


def test_parallel_sampling_children_share_the_prompt_and_are_clean(harness):
    # GIVEN n=4: vLLM's front end fans a request out into children named "{i}_{parent}"
    h = harness()
    for i in range(4):
        h.request(f"{i}_par", _prompt(0), max_tokens=2 * BS)
    h.run()
    events = _clean(h)
    # THEN the children after the first hit the blocks the first one cached in the same step
    assert {e.seq for e in _hits(events)} >= {"1_par", "2_par", "3_par"}


@pytest.mark.parametrize("accepted", ["all", "none", "some"])
def test_speculative_tokens_accepted_or_rejected_are_clean(harness, accepted):
    # GIVEN three draft tokens per step, which the "model" accepts all, none or one of
    h = harness(num_speculative_tokens=3)
    h.accept = {"all": lambda r, d: len(d), "none": lambda r, d: 0, "some": lambda r, d: min(1, len(d))}[accepted]
    h.request("a", _prompt(0), max_tokens=2 * BS)
    h.request("b", _prompt(1), max_tokens=2 * BS)
    # WHEN both decode with drafts to the end
    h.run()
    events = _clean(h)
    # THEN steps verified drafts, and the trace rolled back exactly when the model rejected some
    assert any(type(e) is Batch and max(e.n) == 4 for e in events), "no step verified draft tokens"
    assert any(type(e) is Rollback for e in events) == (accepted != "all")
    assert _ends(events) == {"a": "finished", "b": "finished"}


def test_structured_output_requests_are_clean(harness):
    # GIVEN a structured-output request (its grammar ready, as after compilation) beside a free one,
    # and one whose grammar is still compiling
    h = harness()
    h.request("json", _prompt(0), max_tokens=BS, structured=True)
    h.request("free", _prompt(1), max_tokens=BS)
    compiling = h.request("compiling", _prompt(2), max_tokens=BS, structured=True)
    compiling.structured_output_request.grammar = Future()  # never done: the request waits for its grammar
    # WHEN the waiting one is aborted after a few steps
    for _ in range(3):
        h.step()
    assert compiling.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    h.abort("compiling")
    h.run()
    events = _clean(h)
    # THEN the grammar saw every token sampled for its request
    assert h.added[0].structured_output_request.grammar.num_accepted == BS
    assert _ends(events) == {"json": "finished", "free": "finished", "compiling": "aborted"}


def test_priorities_preempt_the_lower_priority_requests_and_are_clean(harness):
    # GIVEN the priority policy on a small pool filled by low-priority requests
    h = harness(policy="priority", num_blocks=12, max_num_batched_tokens=4 * BS)
    for i in range(3):
        h.request(f"low{i}", _prompt(i), max_tokens=3 * BS, priority=10)
    for _ in range(4):
        h.step()
    # WHEN high-priority requests arrive
    for i in range(3):
        h.request(f"high{i}", _prompt(10 + i, prefix=[700] * (3 * BS)), max_tokens=BS, priority=0)
    h.run(max_steps=400)
    events = _clean(h)
    # THEN a low-priority request was preempted for them, and all finished
    assert any(r.num_preemptions for r in h.added if r.request_id.startswith("low"))
    assert len(_ends(events)) == 6


def test_async_scheduling_with_aborts_while_a_step_is_in_flight_is_clean(harness):
    # GIVEN async scheduling (step N+1 scheduled before step N's output is back) on a pool that preempts
    h = harness(async_scheduling=True, num_blocks=14, max_num_batched_tokens=4 * BS)
    for i in range(6):
        h.request(f"r{i}", _prompt(i), max_tokens=3 * BS)
    aborted = []

    def abort_every_eighth_step() -> bool:
        # WHEN a request whose step is in flight is aborted now and then (as vLLM's test_abort does)
        if h.num_steps % 8 == 7 and len(aborted) < 3 and h.in_flight:
            req_id = next(iter(h.in_flight[-1][0].num_scheduled_tokens), None)
            if req_id is not None and req_id not in aborted:
                aborted.append(req_id)
                h.abort(req_id)
        return not h.scheduler.has_requests() and not h.in_flight

    h.run(until=abort_every_eighth_step, max_steps=400)
    events = _clean(h)
    # THEN vLLM preempted and aborted in flight, and every request ended as it should
    assert aborted and sum(r.num_preemptions for r in h.added) > 0
    assert _ends(events) == {r.request_id: "aborted" if r.request_id in aborted else "finished" for r in h.added}


# ---- KV connector: external hits, asynchronous loads, delayed frees ---------------------


def test_external_hits_loaded_at_once_and_asynchronously_are_clean(harness):
    # GIVEN an external cache holding two blocks of one prompt and three of another (loaded async)
    h = harness(connector=True)
    h.connector.external.update({"sync": 2 * BS, "async": 3 * BS})
    h.connector.load_async.add("async")
    h.request("sync", _prompt(0, prefix=[500] * (3 * BS)), max_tokens=BS)
    h.request("async", _prompt(1, prefix=[600] * (3 * BS)), max_tokens=BS)
    h.step()
    assert h.scheduler.requests["async"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # WHEN the load finishes a step later
    h.recving.add("async")
    h.run()
    events = _clean(h)
    # THEN the computed part of each request started after its external tokens
    assert _first_positions(events) == {"sync": 2 * BS, "async": 3 * BS}


def test_blocks_freed_after_the_connector_finished_sending_are_clean(harness):
    # GIVEN a connector that keeps a finished request's blocks until it has sent them
    h = harness(connector=True)
    h.connector.delay_free.update({"sent", "sent-late"})
    h.request("sent", _prompt(0), max_tokens=4)
    h.request("sent-late", _prompt(1), max_tokens=8)
    h.run(until=lambda: "sent" not in h.scheduler.running and h.scheduler.requests["sent"].is_finished())
    # WHEN the send finishes two steps later, then the other one's at the end
    h.step()
    h.sending.add("sent")
    h.run(until=lambda: not h.scheduler.running)
    h.sending.add("sent-late")
    h.step()
    events = _clean(h)
    assert not h.scheduler.requests, "the delayed blocks were never freed"
    assert _ends(events) == {"sent": "finished", "sent-late": "finished"}


def test_aborts_while_loading_and_while_sending_are_clean(harness):
    # GIVEN one request waiting for an asynchronous load and one finished but still sending
    h = harness(connector=True)
    h.connector.external["loading"] = 3 * BS
    h.connector.load_async.add("loading")
    h.connector.delay_free.add("sending")
    h.request("sending", _prompt(0), max_tokens=2)
    h.request("loading", _prompt(1, prefix=[600] * (3 * BS)), max_tokens=4)
    h.run(until=lambda: h.scheduler.requests["sending"].is_finished())
    assert h.scheduler.requests["loading"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # WHEN both are aborted, and the transfers finish after
    h.abort("loading", "sending")
    assert set(h.scheduler.requests) == {"loading", "sending"}, "a block held for a transfer was freed under it"
    h.recving.add("loading")
    h.sending.add("sending")
    h.step()
    events = _clean(h)
    # THEN the load's blocks were held until it finished, and the finished request stays finished
    assert not h.scheduler.requests
    assert _ends(events) == {"sending": "finished", "loading": "aborted"}


def _example_connector(harness, tmp_path):
    return harness(connector="ExampleConnector", connector_config={"shared_storage_path": str(tmp_path / "kv")})


def test_vllms_example_connector_finishing_requests_is_clean(harness, tmp_path):
    # GIVEN vLLM's ExampleConnector with an empty store: the setup that once killed vLLM's engine core at the
    # first finished request (its scheduler frees skipped blocks with keyword arguments)
    h = _example_connector(harness, tmp_path)
    for i in range(3):
        h.request(f"r{i}", _prompt(i), max_tokens=BS)
    h.run()
    events = _clean(h)
    assert _ends(events) == {f"r{i}": "finished" for i in range(3)}


def test_an_external_hit_in_vllms_example_connector_is_clean(harness, tmp_path):
    # GIVEN vLLM's ExampleConnector whose store holds the KV of one prompt (as its worker half saves it)
    h = _example_connector(harness, tmp_path)
    prompt = _prompt(0, prefix=[500] * (3 * BS))
    stored = (len(prompt) - 1) // BS * BS
    h.connector._generate_foldername_debug(torch.tensor(prompt[:stored]), [], create_folder=True)
    # WHEN that prompt is served
    h.request("stored", prompt, max_tokens=4)
    h.run()
    events = _clean(h)
    # THEN the scheduler computed only what the store did not hold
    assert _first_positions(events) == {"stored": stored}


# ---- bug classes patched into vLLM: each is named ---------------------------------------


def _leaking_free(h, monkeypatch, when) -> list:
    """Patch vLLM's free path to keep the last block of the first request for which ``when(request)``
    holds; returns [(request_id, block)] once it fired."""
    kept, original = [], SingleTypeKVCacheManager.free

    def free(self, request_id):
        req = h.scheduler.requests.get(request_id)
        if req is None or kept or not when(req):
            return original(self, request_id)
        blocks = self.pop_blocks_for_free(request_id)
        kept.append((request_id, blocks.pop()))
        self.block_pool.free_blocks(reversed(blocks))

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free)
    return kept


def _leaks(findings) -> list:
    return [(f.seq, f.block) for f in findings if f.check == "leak" and f.rule == "unreachable"]


def test_a_block_not_freed_on_abort_is_a_leak_naming_request_and_block(harness, monkeypatch):
    # GIVEN vLLM's free path forgets the tail block of an aborted request
    h = harness()
    kept = _leaking_free(h, monkeypatch, lambda r: r.status == RequestStatus.FINISHED_ABORTED)
    for i in range(3):
        h.request(f"r{i}", _prompt(i), max_tokens=BS)
    for _ in range(3):
        h.step()
    h.abort("r1")
    h.run()
    findings, _ = h.findings()
    # THEN the leak check names the aborted request and the forgotten block
    assert kept and _leaks(findings) == [("r1", kept[0][1].block_id)], findings


def test_a_reference_kept_on_preemption_is_a_leak_naming_request_and_block(harness, monkeypatch):
    # GIVEN vLLM's preemption path keeps one reference of the preempted request
    h = harness(num_blocks=14, max_num_batched_tokens=4 * BS)
    kept = _leaking_free(h, monkeypatch, lambda r: r.status == RequestStatus.RUNNING)  # RUNNING: being preempted
    for i in range(6):
        h.request(f"r{i}", _prompt(i), max_tokens=3 * BS)
    h.run(max_steps=400)
    findings, _ = h.findings()
    assert kept, "nothing was preempted: the pool is too large"
    request_id, block = kept[0]
    assert (request_id, block.block_id) in _leaks(findings), findings


def test_a_hash_that_leaves_out_the_cache_salt_is_a_prefix_hash_mismatch(harness, monkeypatch):
    # GIVEN vLLM's block hash forgets the cache salt, and two tenants send the same prompt
    original = kv_cache_utils.generate_block_hash_extra_keys

    def without_salt(request, *args, **kwargs):
        keys, mm_idx = original(request, *args, **kwargs)
        keys = tuple(k for k in keys or () if not (isinstance(k, tuple) and k[:1] == ("cache_salt",)))
        return keys or None, mm_idx

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", without_salt)
    h = harness()
    h.request("tenant-a", _prompt(0), max_tokens=4, cache_salt="a")
    h.run()
    h.request("tenant-b", _prompt(0), max_tokens=4, cache_salt="b")
    h.run()
    findings, _ = h.findings()
    # THEN the prefix check names tenant b's request and the blocks it was served
    mismatches = [f for f in findings if f.rule == "hash-mismatch"]
    assert mismatches and {(f.check, f.seq) for f in mismatches} == {("prefix", "tenant-b")}, findings
    assert len(mismatches) == len(_prompt(0)) // BS and all(isinstance(f.block, int) for f in mismatches)


def test_a_shared_block_freed_twice_is_named_when_its_reader_reads_it(harness, monkeypatch):
    # GIVEN vLLM's free path lists a shared prefix block twice when one of its holders ends
    h, hit = harness(num_blocks=12), []
    original = SingleTypeKVCacheManager.free

    def free(self, request_id):
        blocks = self.pop_blocks_for_free(request_id)
        shared = [b for b in blocks if not b.is_null and b.ref_cnt > 1]
        if request_id == "brief" and shared and not hit:
            hit.append(shared[0].block_id)
            blocks.append(shared[0])
        self.block_pool.free_blocks(reversed(blocks))

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free)
    h.request("reader", _prompt(0), max_tokens=3 * BS)  # holds the shared prefix blocks for a while
    h.request("brief", _prompt(1), max_tokens=1)  # shares them too, and ends first: the bug fires
    h.run(until=lambda: bool(hit))
    for i in range(4):  # new prompts that need fresh blocks: the pool hands the block out again
        h.request(f"other{i}", _prompt(i, prefix=[800 + i] * BS), max_tokens=2)
    h.run(until=lambda: "reader" not in h.scheduler.requests, max_steps=100)
    findings, _ = h.findings()
    # THEN the reader is named reading a block it no longer owns (or one the pool freed under it)
    assert hit, "no shared block was freed"
    named = [f for f in findings if f.block == hit[0] and f.rule in ("read-not-owned", "read-freed")]
    assert named and named[0].seq == "reader", findings


def test_a_read_of_positions_the_scheduler_skipped_is_an_unwritten_read(harness, monkeypatch):
    # GIVEN vLLM's scheduler counting a block more of a long prompt as computed than it scheduled, once: the
    # next chunk starts past a fresh block no step wrote (a slot mapping or count that skips tokens; what
    # attention then reads there is whatever the block held: zeros, another request's K/V, NaN)
    from vllm.v1.core.sched.scheduler import Scheduler

    skipped, original = [], Scheduler._update_after_schedule

    def update_after_schedule(self, output):
        original(self, output)
        request = self.requests.get("long")
        if request is not None and not skipped and request.num_computed_tokens == 2 * BS:
            skipped.append(request.num_computed_tokens)
            request.num_computed_tokens += BS

    monkeypatch.setattr(Scheduler, "_update_after_schedule", update_after_schedule)
    h = harness(max_num_batched_tokens=2 * BS)
    h.request("long", list(range(1000, 1000 + 6 * BS)), max_tokens=2)
    h.request("short", _prompt(1), max_tokens=4)
    h.run()
    findings, events = h.findings()
    # THEN slots/unwritten-read names the request, the skipped block and its positions, once
    assert skipped, "the prompt was never two blocks in"
    (f,) = [f for f in findings if f.rule == "unwritten-read"]
    third = [e.block for e in events if type(e) is Alloc and e.seq == "long"][2]  # the block of positions 32-47
    assert f.check == "slots" and f.seq == "long" and f.block == third, f.message
    assert f.evidence["positions"] == list(range(2 * BS, 3 * BS)) and f"positions {2 * BS}-{3 * BS - 1}" in f.message
    # AND the other request's reads are clean
    assert not [x for x in findings if x.seq == "short"], findings


def test_blocks_freed_while_their_load_is_in_flight_are_named(harness, monkeypatch):
    # GIVEN vLLM's abort path freeing a request's blocks at once even while a KV connector still loads into them
    # (the bug class of vLLM PR #56104 and #50754: the load then writes blocks another request may hold)
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._free_request
    monkeypatch.setattr(Scheduler, "_free_request",
                        lambda self, request, delay_free_blocks=False: original(self, request, delay_free_blocks=False))
    h = harness(connector=True)
    h.connector.external["loading"] = 3 * BS
    h.connector.load_async.add("loading")
    h.request("loading", _prompt(1, prefix=[600] * (3 * BS)), max_tokens=4)
    h.request("other", _prompt(2), max_tokens=4)
    h.step()
    assert h.scheduler.requests["loading"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # WHEN the loading request is aborted before its load finished
    h.abort("loading")
    assert "loading" not in h.scheduler.requests, "vLLM held the blocks: the patch did not take"
    h.run()
    findings, _ = h.findings()
    # THEN the transfer check names the request and each block freed under its load
    freed = [f for f in findings if f.rule == "freed-in-flight"]
    assert freed and {f.seq for f in freed} == {"loading"}, findings
    assert all(f.block is not None and "load" in f.message for f in freed), [f.message for f in freed]
