"""A trace of the engine under a tiny device tier is consistent by docs/trace-format.md, and each fault shows.

A seeded random workload (prompts, decode, forks, rollbacks, aborts, prefetch and
explicit swaps) runs against device 6 / host 6 / disk 10 blocks with tracing switched
on by ``KVDOCTOR_TRACE``. The trace read back must hold swaps through host and disk,
and kvdoctor's own checks must find nothing in it. With a fault switched on, the
same kind of run must produce the finding that names the fault's sequence and block.
"""

from __future__ import annotations

import random

import pytest

from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.errors import OutOfBlocks

from engine_support import Recorder, findings_of, tiny_config


def run_workload(tmp_path, monkeypatch, fault=None, steps=300, seed=0):
    path = tmp_path / f"{fault or 'clean'}.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    cache = PagedKVCache(tiny_config(device_blocks=6, host_blocks=6, disk_blocks=10, prefetch_depth=2,
                                     disk_dir=str(tmp_path), fault=fault))
    r = Recorder(cache)
    rng = random.Random(seed)
    next_id = 0
    for _ in range(steps):
        live = sorted(cache.seqs)
        if len(live) < 4:
            cache.add_sequence(next_id, 0)
            live.append(next_id)
            next_id += 1
        batch = rng.sample(live, k=min(len(live), 2))
        try:
            for seq in batch:
                r.write(seq, rng.choice([1, 1, 1, 5]) if cache.seq_len(seq) < 18 else 0)
        except OutOfBlocks:
            pass
        op = rng.random()
        seq = rng.choice(live)
        if op < 0.08 and len(live) < 6 and cache.seq_len(seq):
            cache.fork(seq, next_id)
            r.kv[next_id] = list(r.kv.get(seq, []))
            next_id += 1
        elif op < 0.16 and cache.seq_len(seq) > 2:
            try:
                cache.rollback(seq, 2)
            except ValueError:
                pass
        elif op < 0.30 or cache.seq_len(seq) >= 18:
            cache.remove_sequence(seq, reason=rng.choice(["finished", "aborted"]))
        elif op < 0.45:
            ids = cache.block_table(seq)
            if ids and seq not in batch:
                try:
                    cache.swap_out(ids[:2], rng.choice(["host", "disk"]))
                except OutOfBlocks:
                    pass
        elif op < 0.55:
            cache.prefetch(seq)
        cache.end_step(len(batch))
    for seq in sorted(cache.seqs):
        cache.remove_sequence(seq)
    cache.end_step()
    cache.close()
    return path


def test_clean_trace_swaps_through_every_tier_and_has_no_findings(tmp_path, monkeypatch):
    reader, events, findings = findings_of(run_workload(tmp_path, monkeypatch))
    kinds = {type(e).__struct_config__.tag for e in events}
    moves = {(e.src, e.dst) for e in events if type(e).__struct_config__.tag in ("swap_out", "swap_in")}
    assert {("device", "host"), ("host", "disk"), ("disk", "device")} <= moves
    assert {"alloc", "share", "release", "free", "write", "swap_out", "swap_in", "rollback", "usage",
            "seq_start", "seq_end", "prefetch"} <= kinds
    assert not reader.truncated and type(events[-1]).__struct_config__.tag == "trace_end"
    assert findings == [], "\n".join(f.message for f in findings)


@pytest.mark.parametrize("fault,rule", [
    ("leak-swapped", "leak/unreachable-swapped"),
    ("stale-version", "stale/stale-swap-in"),
    ("batch-misalign", "batch/write-not-owned"),
])
def test_fault_runs_are_caught_by_the_checks(tmp_path, monkeypatch, fault, rule):
    _, _, findings = findings_of(run_workload(tmp_path, monkeypatch, fault=fault))
    ids = {f"{f.check}/{f.rule}" for f in findings}
    assert rule in ids, sorted(ids)
    assert all(f.block is not None for f in findings if f"{f.check}/{f.rule}" == rule)
