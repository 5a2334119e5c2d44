"""`kvdoctor export --perfetto`: Chrome trace-event JSON with steps, tier counters, transfers,
sequences and findings. Validated structurally by the format's rules here (the perfetto
package's trace processor downloads its binary at run time, which an offline CI cannot), and
through the trace processor itself when a shell binary is named in KVDOCTOR_TP_SHELL."""

from __future__ import annotations

import json

import msgspec
import pytest
from check_traces import leaky_events, with_usage, write_trace

from kvdoctor import events as E
from kvdoctor import knobs
from kvdoctor.cli import main


def _timed(events: list[E.Event]) -> list[E.Event]:
    """The hand-written events with a clock: 10 us apart, so every slice has a place in time."""
    return [msgspec.structs.replace(e, t=(i + 1) * 10_000) for i, e in enumerate(events)]


def _with_prefetch(events: list[E.Event]) -> list[E.Event]:
    out: list[E.Event] = []
    for e in events:
        if isinstance(e, E.StepEnd):
            out.append(E.Prefetch(step=e.step, blocks=[e.step], src="host", dst="device"))
        out.append(e)
    return out


@pytest.fixture
def exported(tmp_path, capsys):
    trace = write_trace(tmp_path / "leaky.kvtrace", _timed(with_usage(_with_prefetch(leaky_events()))))
    out = tmp_path / "leaky.json"
    code = main(["export", str(trace), "--perfetto", str(out)])
    _, err = capsys.readouterr()
    assert code == 0 and "trace events" in err
    return out, json.loads(out.read_text())["traceEvents"]


_REQUIRED = {"X": {"name", "ts", "dur", "pid", "tid"}, "C": {"name", "ts", "pid", "args"},
             "i": {"name", "ts", "pid", "s"}, "b": {"name", "ts", "pid", "id", "cat"},
             "e": {"name", "ts", "pid", "id", "cat"}, "M": {"name", "pid", "args"}}


def _validate(tes: list[dict]) -> None:
    """The trace-event format's rules that the viewers enforce: known phases with their fields,
    numeric non-negative times, numeric counter values, and every async begin closed by an end
    (or left open, which viewers draw to the trace's end) with no end without a begin."""
    open_ids: set = set()
    for te in tes:
        ph = te["ph"]
        assert ph in _REQUIRED, te
        assert _REQUIRED[ph] <= set(te), te
        if ph != "M":
            assert isinstance(te["ts"], (int, float)) and te["ts"] >= 0, te
        if ph == "X":
            assert te["dur"] >= 0, te
        if ph == "C":
            assert all(isinstance(v, (int, float)) for v in te["args"].values()), te
        if ph == "i":
            assert te["s"] in ("g", "p", "t")
        if ph == "b":
            open_ids.add(te["id"])
        if ph == "e":
            assert te["id"] in open_ids, te
            open_ids.discard(te["id"])


def test_export_has_steps_counters_transfers_sequences_and_findings(exported):
    # GIVEN a 4-step trace with a leaked swapped-out block, usage readings and prefetches
    _, tes = exported
    # THEN it obeys the format, and every kind of track is there with the trace's numbers
    _validate(tes)
    steps = [te for te in tes if te.get("cat") == "step"]
    assert [te["name"] for te in steps] == ["step 0", "step 1", "step 2"]
    host = [te["args"]["used"] for te in tes if te["ph"] == "C" and te["name"] == "host blocks"]
    assert host == [0, 1, 1]  # r1's leaked block stays on the host
    assert [te["args"]["bytes"] for te in tes if te["ph"] == "C" and te["name"] == "host KV bytes"] == [0, 4096, 4096]
    transfers = [te["name"] for te in tes if te.get("cat") == "transfer"]
    assert transfers.count("swap_out device->host") == 3 and transfers.count("prefetch host->device") == 3
    assert sum(te["ph"] == "b" for te in tes) == 3 == sum(te["ph"] == "e" for te in tes)
    findings = {te["name"]: te["args"] for te in tes if te["ph"] == "i"}
    assert "leak/unreachable-swapped" in findings and findings["leak/unreachable-swapped"]["block"] == 1
    assert findings["leak/unreachable-swapped"]["message"]


def test_bad_trace_is_one_line_and_exit_3(tmp_path, capsys):
    bad = tmp_path / "bad.kvtrace"
    bad.write_text("not a trace\n")
    code = main(["export", str(bad), "--perfetto", str(tmp_path / "o.json")])
    _, err = capsys.readouterr()
    assert code == 3 and len(err.strip().splitlines()) == 1 and not (tmp_path / "o.json").exists()


def test_unwritable_output_is_exit_2(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.kvtrace", _timed(leaky_events()))
    code = main(["export", str(trace), "--perfetto", str(tmp_path / "no" / "such" / "dir.json")])
    assert code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.skipif(not knobs.get(knobs.TP_SHELL),
                    reason="the perfetto package downloads trace_processor_shell at run time; "
                           "set KVDOCTOR_TP_SHELL to a local binary to run this")
def test_trace_processor_reads_the_export(exported):
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    path, _ = exported
    tp = TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=knobs.get(knobs.TP_SHELL)))
    try:
        steps = tp.query("select count(*) as n from slice where name like 'step %'").as_pandas_dataframe()
        assert int(steps["n"][0]) == 3
        host = tp.query("select c.value from counter c join counter_track t on c.track_id = t.id "
                        "where t.name = 'host blocks used' order by c.ts").as_pandas_dataframe()
        assert list(host["value"]) == [0, 1, 1]
        leak = tp.query("select count(*) as n from slice where name = 'leak/unreachable-swapped' and dur = 0")
        assert int(leak.as_pandas_dataframe()["n"][0]) == 1
    finally:
        tp.close()


def test_a_workload_exports_a_process_per_trace_on_one_wall_clock_timeline(tmp_path, capsys):
    # GIVEN two traces of one workload, the second started 1 ms after the first and leaking
    quiet = [E.StepEnd(t=10_000, step=0)]
    first = write_trace(tmp_path / "run.kvtrace", quiet, header=E.Header(
        block_size=4, num_layers=2, tiers=[E.TierSpec(name="device", capacity_blocks=8)], t0=10**9, instance="a"))
    write_trace(tmp_path / "run.2.kvtrace", _timed(leaky_events()), header=E.Header(
        block_size=4, num_layers=2, tiers=[E.TierSpec(name="device", capacity_blocks=8)], t0=10**9 + 10**6,
        instance="b"))
    out = tmp_path / "workload.json"
    # WHEN the directory is exported
    assert main(["export", str(tmp_path), "--perfetto", str(out)]) == 0
    capsys.readouterr()
    events = json.loads(out.read_text())["traceEvents"]
    # THEN each trace is a process named by its instance, the second's steps 1 ms later on the shared timeline
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "kvdoctor instance a", 2: "kvdoctor instance b"}
    first_steps = [e["ts"] for e in events if e.get("cat") == "step" and e["pid"] == 2]
    assert first_steps and first_steps[0] >= 1000.0
    # AND the leak's finding sits on the second process, naming its trace
    found = [e for e in events if e.get("cat", "").startswith("finding")]
    assert found and {e["pid"] for e in found} == {2} and found[0]["args"]["trace"].endswith("run.2.kvtrace")
    assert str(first) != found[0]["args"]["trace"]
