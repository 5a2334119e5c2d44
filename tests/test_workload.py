"""kvdoctor.workload: every trace of a workload, each checked on its own, merged for the rules across them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvdoctor.config import Config
from kvdoctor.errors import TraceError
from kvdoctor.events import Alloc, Header, SeqEnd, SeqStart, StepEnd, TierSpec, TransferDone, TransferStart
from kvdoctor.trace import TraceWriter
from kvdoctor.workload import TraceSet, WorkloadSession, trace_files

KVDOCTOR = [sys.executable, "-c", "from kvdoctor.cli import main; raise SystemExit(main())"]


def header(**kw) -> Header:
    return Header(block_size=4, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=8)], **kw)


def leaky() -> list:
    """A request that ends while still holding its block: a leak in the trace it is in."""
    return [SeqStart(t=1, seq="a", prompt_len=4), Alloc(t=2, block=0, tier="device", seq="a"),
            SeqEnd(t=3, seq="a"), StepEnd(t=4)]


def write(path, events, **kw) -> str:
    with TraceWriter(path, header(**kw)) as w:
        w.write_many(events)
    return str(path)


def test_a_directory_is_read_in_the_writers_numbering_and_each_finding_names_its_trace(tmp_path):
    # GIVEN the traces of one process's three caches, the third leaking
    for name in ("run.kvtrace", "run.10.kvtrace", "run.2.kvtrace"):
        write(tmp_path / name, leaky() if name == "run.10.kvtrace" else [StepEnd(t=1)])
    assert [p.rsplit("/", 1)[1] for p in trace_files([str(tmp_path)])] == ["run.kvtrace", "run.2.kvtrace",
                                                                           "run.10.kvtrace"]
    # WHEN the directory is checked as one workload
    session = WorkloadSession(TraceSet.open([str(tmp_path)])).run()
    # THEN the leak is found in the third trace, and the report names all three
    report = session.report()
    assert {f.trace for f in report.findings} == {str(tmp_path / "run.10.kvtrace")} and report.exit_code == 1
    assert report.notes[0].startswith("3 traces: ") and report.num_events == 2 + 2 + 5


def test_an_unusable_trace_is_named_never_skipped(tmp_path):
    # GIVEN a clean trace and, beside it, a file with the trace suffix that is no trace
    write(tmp_path / "a.kvtrace", [StepEnd(t=1)])
    (tmp_path / "b.kvtrace").write_text("not a header\n")
    report = WorkloadSession(TraceSet.open([str(tmp_path)])).run().report()
    # THEN the report names it in a note and an error, so the gate fails
    assert [f.rule for f in report.findings] == ["unusable-trace"] and report.findings[0].trace.endswith("b.kvtrace")
    assert any("b.kvtrace could not be used" in n for n in report.notes) and report.exit_code == 1


def test_events_merge_by_wall_clock_not_by_each_traces_own_clock(tmp_path):
    # GIVEN a prefill trace that saves from t=500 to t=2 ms, and a decode trace started 3 ms after it that loads
    # at its own t=100
    save = [TransferStart(t=500, transfer="s", op="save", blocks=[0], seq="p", key="k", digests=[1]),
            TransferDone(t=2 * 10**6, transfer="s")]
    load = [TransferStart(t=100, transfer="l", op="load", blocks=[3], seq="d", key="k"),
            TransferDone(t=110, transfer="l", digests=[1])]
    paths = [write(tmp_path / "p.kvtrace", save, instance="prefill", t0=10**9),
             write(tmp_path / "d.kvtrace", load, instance="decode", t0=10**9 + 3 * 10**6)]
    # THEN the load comes after the finished save: no finding
    assert WorkloadSession(TraceSet.open(paths)).run().findings == []
    # AND a decode started 1 ms after the prefill loads while the save is still in flight: named
    write(tmp_path / "d.kvtrace", load, instance="decode", t0=10**9 + 10**6)
    found = WorkloadSession(TraceSet.open(paths)).run().findings
    assert [f.rule for f in found] == ["load-unsaved"] and found[0].trace == paths[1]


def test_a_followed_directory_takes_in_traces_that_appear_later(tmp_path):
    # GIVEN a followed directory with one live trace, and a second trace (leaking) written a moment later
    first = TraceWriter(tmp_path / "run.kvtrace", header(pid=None))
    first.write_many([StepEnd(t=1)])

    def later() -> None:
        time.sleep(0.6)
        write(tmp_path / "run.2.kvtrace", leaky())
        time.sleep(0.6)
        first.close()

    threading.Thread(target=later).start()
    session = WorkloadSession(TraceSet.open([str(tmp_path)], follow=True, wait_s=5), Config()).run()
    # THEN the second trace was found while following, and its leak named
    assert session.findings and {f.trace.rsplit("/", 1)[1] for f in session.findings} == {"run.2.kvtrace"}
    assert len(session.members) == 2


TWO_ENGINES = '''
import sys, tempfile
import torch
from kvdoctor.engine import EngineConfig, PagedKVCache

def run(fault=None):
    cache = PagedKVCache(EngineConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                                      device_blocks=4, host_blocks=4, disk_blocks=8, chunk_blocks=2,
                                      disk_dir=tempfile.mkdtemp(), fault=fault))
    cache.add_sequence("a", prompt_len=8)
    slots = cache.reserve("a", 8)
    for layer in range(2):
        cache.store(layer, slots, torch.randn(8, 2, 8), torch.randn(8, 2, 8))
    cache.commit("a", 8)
    cache.end_step()
    away, home = cache.block_table("a")
    cache.swap_out([away], "host")
    cache.remove_sequence("a")
    cache.end_step()
    cache.close()

run()
run(sys.argv[1] if len(sys.argv) > 1 else None)   # the second engine: leaks its swapped block when asked
'''


def test_check_of_a_command_reads_every_trace_it_writes(tmp_path):
    # GIVEN a process that builds two engines, the second leaking a swapped-out block
    script = tmp_path / "two_engines.py"
    script.write_text(TWO_ENGINES)
    leaking = subprocess.run([*KVDOCTOR, "check", "--", sys.executable, str(script), "leak-swapped"],
                             capture_output=True, text=True, timeout=300)
    # THEN `kvdoctor check -- CMD` finds the leak in the second trace and fails the gate
    assert leaking.returncode == 1, leaking.stdout + leaking.stderr
    assert "leak/unreachable-swapped" in leaking.stdout and "trace workload.2.kvtrace" in leaking.stdout
    assert "2 traces: workload.kvtrace, workload.2.kvtrace" in leaking.stdout
    # AND the same process with both engines clean passes with nothing to say
    clean = subprocess.run([*KVDOCTOR, "check", "--", sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300)
    assert clean.returncode == 0 and "0 errors, 0 warnings, 0 info" in clean.stdout, clean.stdout + clean.stderr


def test_info_export_and_replay_take_a_workloads_traces(tmp_path, capsys):
    import json

    from kvdoctor.cli import main
    from kvdoctor.commands.replay import _pick

    # GIVEN two ranks' traces in a directory
    for rank in (0, 1):
        write(tmp_path / f"rank{rank}.kvtrace", [StepEnd(t=1)], instance="p", tp_rank=rank, tp_size=2, t0=5)
    # WHEN info reads the directory THEN one summary per trace, each saying who wrote it
    assert main(["info", str(tmp_path), "--json"]) == 0
    infos = json.loads(capsys.readouterr().out)
    assert [i["producer"] for i in infos] == [{"instance": "p", "tp_rank": r, "tp_size": 2, "t0": 5} for r in (0, 1)]
    # AND replay shows one of them, chosen by place or name, and lists the others
    assert _pick([str(tmp_path)], "rank1.kvtrace").endswith("rank1.kvtrace")
    assert _pick([str(tmp_path)], "1").endswith("rank0.kvtrace") and "2 rank1.kvtrace" in capsys.readouterr().err


def test_a_trace_without_t0_counts_from_the_earliest_t0_of_the_workload(tmp_path):
    # GIVEN an old trace with no t0 that saves at t=100 and a newer one (t0 set) that loads at t=500
    save = [TransferStart(t=100, transfer="s", op="save", blocks=[0], seq="p", key="k", digests=[1]),
            TransferDone(t=200, transfer="s")]
    load = [TransferStart(t=500, transfer="l", op="load", blocks=[3], seq="d", key="k"),
            TransferDone(t=510, transfer="l", digests=[2])]
    paths = [write(tmp_path / "a.kvtrace", save, instance="prefill"),
             write(tmp_path / "b.kvtrace", load, instance="decode", t0=10**18)]
    # THEN the save comes first (both count from 10**18), and the load's other content is named
    found = WorkloadSession(TraceSet.open(paths)).run().findings
    assert [f.rule for f in found] == ["digest-mismatch"]


def test_a_followed_directory_waits_for_its_first_trace(tmp_path):
    # GIVEN a directory followed before any writer started, and a writer that starts a moment later
    threading.Timer(0.5, lambda: write(tmp_path / "run.kvtrace", leaky())).start()
    session = WorkloadSession(TraceSet.open([str(tmp_path)], follow=True, wait_s=5)).run()
    # THEN its trace is checked
    assert [m.tag.name.rsplit("/", 1)[1] for m in session.members] == ["run.kvtrace"] and session.findings
    # AND with no writer at all, the wait ends with one line
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="no trace appeared in .*empty within 0.3 s"):
        WorkloadSession(TraceSet.open([str(empty)], follow=True, wait_s=0.3)).run()
