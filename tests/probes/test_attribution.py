"""Attribution: a finding carries the heap growth since its sequence started, stacks and memory."""

import threading

import pytest

from kvdoctor.attribution import Attributor
from kvdoctor.engine.bus import Bus
from kvdoctor.events import Mem, SeqStart
from kvdoctor.findings import Finding
from kvdoctor.probes import attach_probes
from kvdoctor.probes.heap import HeapProbe

LEAK = dict(check="leak", rule="swapped_out_unfreed", severity="error", message="block 3 leaked", block=3)

_retained: list = []  # what the "leaky engine" below keeps alive


def leaky_step(n: int) -> None:
    for i in range(n):
        _retained.append(("kv-meta", i, [i] * 8))  # leaky-line


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(n for n, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


@pytest.fixture
def live():
    """A bus with probes and an attributor subscribed, as a live in-process session wires them."""
    bus = Bus()
    prober = attach_probes(bus, lambda: {"device": 1 << 20}, interval_s=3600, heap=True)
    attributor = Attributor(prober=prober, min_snapshot_interval_s=0.0)
    bus.subscribe(attributor)
    yield bus, attributor
    prober.detach()
    _retained.clear()


def test_growing_structure_is_attributed_to_its_file_and_line(live):
    bus, attributor = live
    # GIVEN sequence 7 started in step 0
    bus.emit(SeqStart, seq=7, prompt_len=4)
    bus.end_step(4)
    # WHEN the workload keeps 10 000 tuples alive while seq 7 runs, and a leak finding fires about it
    leaky_step(10_000)
    finding = attributor.enrich(Finding(seq=7, **LEAK))
    # THEN the heap growth since seq 7 started names the line that allocated them
    growth = finding.attribution["heap_growth"]
    assert growth["since"] == "seq_start" and growth["since_step"] == 0
    top = growth["sites"][0]
    assert top["site"] == f"{__file__}:{_line('leaky-line')}"
    assert top["count_diff"] >= 10_000 and top["size_diff"] > 10_000 * 100
    # AND a fresh memory reading was taken (and emitted) because the finding fired
    assert finding.attribution["mem_now"]["kv_bytes"] == 1 << 20
    bus.flush()
    assert finding.attribution["mem_recent"][0]["source"] == "start"
    assert finding.key == Finding(seq=7, **LEAK).key  # attribution never changes identity


def test_from_another_thread_the_latest_reading_is_attached_without_touching_the_bus(live):
    bus, attributor = live
    bus.flush()
    results = []
    worker = threading.Thread(target=lambda: results.append(attributor.enrich(Finding(seq=1, **LEAK))))
    worker.start()
    worker.join()
    attribution = results[0].attribution
    assert "mem_now" not in attribution and attribution["mem_last"]["kv_bytes"] == 1 << 20
    assert attributor.prober.num_readings == 1  # only the one taken at attach


def test_unknown_sequence_falls_back_to_the_oldest_snapshot_and_says_so(live):
    bus, attributor = live
    bus.emit(SeqStart, seq="a", prompt_len=1)
    bus.end_step(1)
    leaky_step(2_000)
    growth = attributor.enrich(Finding(seq="never-started", **LEAK)).attribution["heap_growth"]
    assert growth["since"] == "oldest_kept_snapshot"
    assert growth["sites"][0]["site"].endswith(f":{_line('leaky-line')}")


def test_snapshots_are_bounded_and_shared_within_the_interval():
    heap = HeapProbe()
    try:
        attributor = Attributor(heap=heap, max_snapshots=2, min_snapshot_interval_s=0.0)
        for step in range(5):
            attributor([SeqStart(seq=step, prompt_len=1, step=step)])
        assert len(attributor._snapshots) == 2
        shared = Attributor(heap=heap, min_snapshot_interval_s=3600)
        for step in range(5):
            shared([SeqStart(seq=step, prompt_len=1, step=step)])
        assert len(shared._snapshots) == 1 and len(set(shared._seq_snapshot.values())) == 1
    finally:
        heap.close()


def test_without_heap_or_prober_only_the_observed_memory_curve_is_attached():
    # GIVEN an attributor following a trace of another process (no tracemalloc here)
    attributor = Attributor()
    for i in range(20):
        attributor.observe(Mem(rss=i, t=i, step=i))
    attribution = attributor.enrich(Finding(seq=1, **LEAK)).attribution
    # THEN the latest readings are there, bounded, oldest first; no heap growth is invented
    assert [m["rss"] for m in attribution["mem_recent"]] == list(range(4, 20))
    assert "heap_growth" not in attribution and "stacks" not in attribution


def test_a_workload_kvdoctor_started_gets_a_stack_dump(ptrace_permitted):
    attributor = Attributor(pid=ptrace_permitted.pid, pyspy_timeout_s=20)
    attribution = attributor.enrich(Finding(seq=1, **LEAK)).attribution
    # THEN the stacks read as lines: a thread header, then its frames innermost first
    stacks = attribution["stacks"]
    assert stacks[0].startswith("Thread ")
    assert any(line.strip().startswith("decode_forever (") and "workload.py:" in line for line in stacks)
    assert attribution["stacks_pid"] == ptrace_permitted.pid


def test_a_finding_with_recorded_stacks_gets_no_dump(child_workload):
    # GIVEN a finding whose events carried the user's stack THEN no py-spy dump is taken for it
    recorded = Finding(seq=1, stacks={"alloc": ["serve.py:8 append"]}, **LEAK)
    attribution = Attributor(pid=child_workload.pid).enrich(recorded).attribution
    assert not {"stacks", "stacks_error"} & set(attribution)


def test_a_stack_dump_that_fails_says_why_instead_of_raising(child_workload):
    pid = child_workload.pid
    child_workload.kill()
    child_workload.wait()
    attribution = Attributor(pid=pid).enrich(Finding(seq=1, **LEAK)).attribution
    assert "stacks" not in attribution and "py-spy" in attribution["stacks_error"]
