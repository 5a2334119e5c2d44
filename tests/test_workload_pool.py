"""kvdoctor.workload_pool: finished traces checked by worker processes give what one process gives, in its order."""

from __future__ import annotations

import os
import signal
import threading

import msgspec
import pytest

from kvdoctor.events import (Alloc, Attn, Batch, Free, Header, Read, SeqEnd, SeqStart, StepEnd, TierSpec,
                             TransferDone, TransferStart, Write)
from kvdoctor.report import render
from kvdoctor.trace import TraceWriter
from kvdoctor.workload import TraceSet, WorkloadSession
from kvdoctor.workload_pool import WorkerFailed, WorkerPool, _start_method

STEPS = 400  # enough events that each trace is decoded in several batches, so the merge interleaves them


def rank_events(*, diverge_at: int | None = None, leak_at: tuple[int, ...] = (), stale_at: tuple[int, ...] = (),
                t_step: int = 1000) -> list:
    """One engine rank's steps: a request per step with one block written, read at two layers and freed; a block
    given to another id at ``diverge_at``, kept after its request ended at ``leak_at``, read at an old version
    at ``stale_at``."""
    out: list = []
    for step in range(STEPS):
        t, seq, block = step * t_step, f"r{step}", 100 + step % 50
        if step == diverge_at:
            block = 999
        ev = [SeqStart(t=t, step=step, seq=seq, prompt_len=4),
              Batch(t=t + 1, step=step, rows=[seq], positions=[0], n=[4]),
              Alloc(t=t + 2, step=step, block=block, tier="device", seq=seq),
              Write(t=t + 3, step=step, block=block, seq=seq, pos=0, n=4, version=4),
              Read(t=t + 4, step=step, seq=seq, blocks=[block], versions=[3 if step in stale_at else 4])]
        ev += [Attn(t=t + 5 + layer, step=step, seq=seq, layer=layer, max_logit=5.0, entropy=1.0, sink=0.3,
                    nonfinite=0) for layer in range(2)]
        ev.append(SeqEnd(t=t + 8, step=step, seq=seq, reason="finished"))
        if step not in leak_at:
            ev.append(Free(t=t + 9, step=step, block=block))
        ev.append(StepEnd(t=t + 10, step=step))
        out += ev
    return out


def handoff(digest: int, t: int, op: str, step: int) -> list:
    start = TransferStart(t=t, step=step, transfer=f"{op}-1", op=op, blocks=[7], seq="h", key="k1", num_tokens=4,
                          digests=[digest] if op == "save" else None)
    return [start, TransferDone(t=t + 5, step=step, transfer=f"{op}-1", digests=[digest] if op == "load" else None)]


def header(**who) -> Header:
    return Header(block_size=4, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=1024)], **who)


def write(path, h: Header, events: list) -> str:
    with TraceWriter(path, h) as w:
        w.write_many(events)
    return str(path)


def faulty_workload(tmp_path) -> list[str]:
    """Three tensor-parallel ranks of one engine (rank 2 diverging mid-trace, ranks leaking and reading stale
    blocks at different steps) and a prefill and a decode instance whose handoff loads other K/V than was saved."""
    t0 = 10**12
    ranks = [write(tmp_path / f"rank{r}.kvtrace", header(instance="e", tp_rank=r, tp_size=3, t0=t0 + r * 777),
                   rank_events(diverge_at=250 if r == 2 else None, leak_at=(30, 300), stale_at=(120 * (r + 1),)))
             for r in range(3)]
    prefill = write(tmp_path / "prefill.kvtrace", header(instance="p", t0=t0), rank_events(leak_at=(5,)) +
                    handoff(11, STEPS * 1000, "save", STEPS))
    decode = write(tmp_path / "decode.kvtrace", header(instance="d", t0=t0 + 50), rank_events(stale_at=(9,)) +
                   handoff(12, STEPS * 1000 + 100, "load", STEPS))
    return [*ranks, prefill, decode]


def both_ways(paths: list[str]) -> tuple[WorkloadSession, WorkloadSession]:
    here = WorkloadSession(TraceSet.open(paths), workers=1).run()
    pooled = WorkloadSession(TraceSet.open(paths), workers=2).run()
    assert here._pool is None and pooled._pool is not None
    return here, pooled


def test_workers_find_what_one_process_finds_in_its_order(tmp_path):
    # GIVEN a workload of five traces with faults in each, per trace and across traces
    paths = faulty_workload(tmp_path)
    # WHEN it is checked in this process and by two worker processes
    here, pooled = both_ways(paths)
    # THEN the faults are found: leaks and stale reads per trace, the rank's divergence, the foreign K/V loaded
    found = {(f.rule, os.path.basename(f.trace or "")) for f in here.findings}
    assert ("divergence", "rank2.kvtrace") in found and ("digest-mismatch", "decode.kvtrace") in found
    assert {r for r, _ in found} >= {"divergence", "digest-mismatch", "stale-read", "unreachable"}
    [divergence] = [f for f in here.findings if f.rule == "divergence"]
    assert divergence.step == 250 and divergence.block == 999 and "alloc 999" in divergence.message
    # AND both ways give the same findings, evidence and order, the same report, and the same counts
    assert msgspec.json.encode(pooled.findings) == msgspec.json.encode(here.findings)
    assert render(pooled.report(), "json") == render(here.report(), "json")
    assert pooled.num_events == here.num_events == 5 * len(rank_events()) - 7 + 4 + 5  # 5 trace_end events


def test_a_clean_workload_is_silent_both_ways(tmp_path):
    paths = [write(tmp_path / f"rank{r}.kvtrace", header(instance="e", tp_rank=r, tp_size=2, t0=10**12 + r),
                   rank_events()) for r in range(2)]
    here, pooled = both_ways(paths)
    assert here.findings == pooled.findings == []


def test_an_unreadable_line_is_named_both_ways(tmp_path):
    # GIVEN two traces, the second with a malformed line in the middle
    paths = [write(tmp_path / f"w{i}.kvtrace", header(t0=10**12), rank_events()) for i in range(2)]
    lines = open(paths[1], "rb").read().split(b"\n")
    lines[len(lines) // 2] = b'{"kind": "alloc", "t": "soon"}'
    open(paths[1], "wb").write(b"\n".join(lines))
    # THEN both ways name the trace as unusable past that line, with the reader's words
    here, pooled = both_ways(paths)
    assert [f.rule for f in here.findings if f.rule == "unusable-trace"] == ["unusable-trace"]
    assert msgspec.json.encode(pooled.findings) == msgspec.json.encode(here.findings)
    assert pooled.report().notes == here.report().notes


def test_a_worker_that_dies_is_an_error_naming_its_trace(tmp_path, monkeypatch):
    # GIVEN a worker killed while it checks the second trace (as the kernel's OOM killer would)
    paths = [write(tmp_path / f"w{i}.kvtrace", header(t0=10**12), rank_events()) for i in range(2)]
    real = WorkerPool.add

    def add(self, tag, path):
        trace = real(self, tag, path)
        if tag.index == 1:
            _, process = self._running[1]
            os.kill(process.pid, signal.SIGKILL)
        return trace

    monkeypatch.setattr(WorkerPool, "add", add)
    # THEN the check stops with an error that names it, instead of waiting for it
    with pytest.raises(WorkerFailed, match=r"w1\.kvtrace was killed by signal 9"):
        WorkloadSession(TraceSet.open(paths), workers=2).run()


def test_ranks_that_all_differ_from_the_first_at_one_step_are_each_named_both_ways(tmp_path):
    # GIVEN three ranks, the second and third each giving the request another block than the first at step 250
    paths = [write(tmp_path / f"rank{r}.kvtrace", header(instance="e", tp_rank=r, tp_size=3, t0=10**12 + r),
                   rank_events(diverge_at=250 if r else None)) for r in range(3)]
    # THEN each is named against the first (whose decisions the workers' path reads again once), both ways alike
    here, pooled = both_ways(paths)
    assert [(f.rule, f.step, os.path.basename(f.trace)) for f in here.findings] == [
        ("divergence", 250, "rank1.kvtrace"), ("divergence", 250, "rank2.kvtrace")]
    assert msgspec.json.encode(pooled.findings) == msgspec.json.encode(here.findings)


def test_a_process_with_other_threads_starts_its_workers_without_fork(tmp_path):
    # GIVEN a thread running beside the check (a fork would copy whatever lock it holds into each worker)
    paths = faulty_workload(tmp_path)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert _start_method() != "fork"
        # THEN the workers, started afresh, still find what one process finds
        here, pooled = both_ways(paths)
    finally:
        stop.set()
        thread.join()
    assert msgspec.json.encode(pooled.findings) == msgspec.json.encode(here.findings) and here.findings


def test_one_cpu_or_followed_traces_are_checked_in_this_process(tmp_path, monkeypatch):
    paths = [write(tmp_path / f"w{i}.kvtrace", header(t0=10**12), rank_events(leak_at=(3,))) for i in range(2)]
    # GIVEN a process allowed one CPU THEN no workers, and the same findings
    monkeypatch.setattr("kvdoctor.workload.available_cpus", lambda: 1)
    alone = WorkloadSession(TraceSet.open(paths)).run()
    # AND traces followed (as if still written) are read here whatever the CPUs
    followed = WorkloadSession(TraceSet.open(paths, follow=True, wait_s=5), workers=2).run()
    assert alone._pool is None and followed._pool is None
    assert msgspec.json.encode(alone.findings) == msgspec.json.encode(followed.findings) and alone.findings
