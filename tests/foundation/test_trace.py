"""Trace files: written live, read back whole, cut short, corrupt, foreign, or still being written."""

from __future__ import annotations

import gzip
import math
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest

from kvdoctor import events as E
from kvdoctor.errors import IncompatibleTraceError, TraceError, TraceFormatError
from kvdoctor.trace import TraceReader, TraceWriter, follow, read_header

HEADER = E.Header(block_size=16, num_layers=2, tiers=[E.TierSpec(name="device", capacity_blocks=8)])


def _steps(num_steps: int) -> list[E.Event]:
    out: list[E.Event] = []
    for s in range(num_steps):
        out += [E.Alloc(t=s * 10, step=s, block=s, tier="device", seq=1),
                E.Write(t=s * 10 + 1, step=s, block=s, seq=1, pos=s * 16, n=16, version=(s + 1) * 16),
                E.StepEnd(t=s * 10 + 2, step=s, num_tokens=16)]
    return out


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.gz", "t.kvtrace.msgpack"])
def test_write_then_read_back(tmp_path, name):
    # GIVEN events written through the writer, plain and gzip
    events = _steps(5)
    with TraceWriter(tmp_path / name, HEADER) as w:
        w.write_many(events)
    # WHEN read back THEN the same events, then the closing event
    reader = TraceReader(tmp_path / name)
    got = list(reader)
    assert got[:-1] == events and type(got[-1]) is E.TraceEnd
    assert reader.header == HEADER and reader.closed and not reader.truncated
    assert reader.num_events == len(events) + 1
    if name.endswith(".gz"):
        assert gzip.open(tmp_path / name).readline().startswith(b'{"kind":"header"')


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.msgpack"])
def test_writer_flushes_each_step_so_a_kill_loses_at_most_one_step(tmp_path, name):
    # GIVEN a writer that has finished two steps and is inside a third
    w = TraceWriter(tmp_path / name, HEADER)
    events = _steps(3)
    w.write_many(events[:3])
    w.write_many(events[3:6])
    w.write(events[6])
    # WHEN another reader looks before close THEN both complete steps are on disk
    got = list(TraceReader(tmp_path / name))
    assert got[:6] == events[:6]
    w.close()


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.msgpack"])
def test_truncated_last_line_is_reported_and_the_rest_used(tmp_path, name):
    path = tmp_path / name
    with TraceWriter(path, HEADER) as w:
        w.write_many(_steps(3))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # cut into the closing line
    reader = TraceReader(path)
    got = list(reader)
    assert reader.truncated and not reader.closed
    assert got == _steps(3)


def test_truncated_gzip_keeps_what_came_before(tmp_path):
    path = tmp_path / "t.kvtrace.gz"
    w = TraceWriter(path, HEADER)
    w.write_many(_steps(50))  # flushed as whole steps, with no gzip trailer yet: as if killed
    reader = TraceReader(path)
    got = list(reader)
    assert reader.truncated
    assert got == _steps(50)
    w.close()


def test_corrupt_line_names_file_and_line(tmp_path):
    path = tmp_path / "t.kvtrace"
    with TraceWriter(path, HEADER) as w:
        w.write_many(_steps(3))
    lines = path.read_bytes().split(b"\n")
    lines[4] = b'{"kind":"write","block":"oops"}'
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(TraceFormatError) as err:
        list(TraceReader(path))
    assert err.value.line == 5 and str(path) in str(err.value)


def test_other_major_version_is_refused(tmp_path):
    path = tmp_path / "t.kvtrace"
    path.write_text('{"kind":"header","format":"kvdoctor-trace","version":"2.0","block_size":16,'
                    '"num_layers":1,"tiers":[]}\n')
    with pytest.raises(IncompatibleTraceError, match="2.0"):
        read_header(path)


def test_newer_minor_version_unknown_kinds_and_fields_are_read(tmp_path):
    # GIVEN a 1.7 trace written by hand with a kind and fields this version lacks
    path = tmp_path / "t.kvtrace"
    path.write_text(textwrap.dedent("""\
        {"kind":"header","format":"kvdoctor-trace","version":"1.7","block_size":16,"num_layers":1,"tiers":[],"new":1}
        {"kind":"seq_start","t":0,"step":0,"seq":"a","prompt_len":3,"tenant":"x"}
        {"kind":"kernel_launch","t":5,"step":0,"grid":[1,2]}
        {"kind":"seq_end","t":9,"step":0,"seq":"a","reason":"finished"}
        """))
    got = list(TraceReader(path))
    assert got[0] == E.SeqStart(seq="a", prompt_len=3)
    assert got[1] == E.Unknown(kind="kernel_launch", t=5, step=0, fields={"grid": [1, 2]})
    assert got[2] == E.SeqEnd(t=9, seq="a", reason="finished")


@pytest.mark.parametrize("content, error", [
    (b"", IncompatibleTraceError),
    (b"hello world\n", IncompatibleTraceError),
    (b'{"kind":"header","format":"other","version":"1.0","block_size":1,"num_layers":1,"tiers":[]}\n',
     IncompatibleTraceError),
    (b"\x1f\x8b\x08garbage", TraceError),
])
def test_not_a_trace(tmp_path, content, error):
    path = tmp_path / "x.kvtrace"
    path.write_bytes(content)
    with pytest.raises(error):
        list(TraceReader(path))


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        TraceReader(tmp_path / "nope.kvtrace")


def test_full_disk_is_a_clear_error_and_keeps_earlier_steps(tmp_path):
    # /dev/full fails every write with ENOSPC
    w = TraceWriter(tmp_path / "t.kvtrace", HEADER)
    w._f = open("/dev/full", "wb", buffering=0)
    with pytest.raises(TraceError, match="No space left"):
        w.write_many(_steps(1))
    assert read_header(tmp_path / "t.kvtrace") == HEADER


_WRITER = """
import sys, time
from kvdoctor import events as E
from kvdoctor.trace import TraceWriter
h = E.Header(block_size=16, num_layers=2, tiers=[], pid=None)
w = TraceWriter(sys.argv[1], h)
for s in range(int(sys.argv[2])):
    w.write_many([E.Alloc(t=s, step=s, block=s, tier="device", seq=0), E.StepEnd(t=s, step=s)])
    time.sleep(0.01)
if sys.argv[3] == "close":
    w.close()
"""


@pytest.mark.parametrize("ending", ["close", "exit"])
@pytest.mark.parametrize("name", ["live.kvtrace", "live.kvtrace.msgpack"])
def test_follow_a_file_written_by_another_process(tmp_path, ending, name):
    # GIVEN a writer process that starts after the follower and writes 40 steps over ~0.4 s
    path = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "40", ending])
    follower = follow(path, pid=proc.pid, poll_s=0.01, wait_s=30)
    # WHEN followed THEN every event arrives in order, and it ends by the writer's close or its exit
    got = list(follower)
    proc.wait()
    allocs = [e for e in got if type(e) is E.Alloc]
    assert [e.block for e in allocs] == list(range(40))
    assert follower.ended == ("closed" if ending == "close" else "writer-gone")


def test_follow_stops_when_asked(tmp_path):
    path = tmp_path / "t.kvtrace"
    w = TraceWriter(path, HEADER)
    w.write_many(_steps(1))
    stop = threading.Event()
    follower = follow(path, stop=stop, poll_s=0.01)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    got = list(follower)
    assert got == _steps(1) and follower.ended == "stopped"
    assert time.monotonic() - t0 < 5
    w.close()


def test_follow_gives_up_on_a_trace_that_never_appears(tmp_path):
    with pytest.raises(TraceError, match="waited"):
        list(follow(tmp_path / "never.kvtrace", wait_s=0.2, poll_s=0.01))


def test_binary_trace_keeps_unknown_kinds_and_names_a_corrupt_frame(tmp_path):
    # GIVEN a binary trace holding a producer's own kind
    path = tmp_path / "t.kvtrace.msgpack"
    odd = E.Unknown(kind="gpu_sync", t=3, step=0, fields={"stream": 2})
    with TraceWriter(path, HEADER) as w:
        w.write_many([E.Free(block=1), odd, E.StepEnd()])
        w.write_many([E.Free(step=1, block=2), E.StepEnd(step=1)])
    # THEN it reads back whole, the unknown kind included
    assert list(TraceReader(path))[:3] == [E.Free(block=1), odd, E.StepEnd()]
    # WHEN a byte inside frame 2 is corrupted THEN the error names that frame
    data = bytearray(path.read_bytes())
    data[-30] = 0xC1  # a byte msgpack never uses
    path.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="frame"):
        list(TraceReader(path))


def _long_trace(num_steps: int = 300) -> list[list[E.Event]]:
    """Steps of every shape the reader must split: growing block lists, one read longer than a
    megabyte of chunking would hold in a line, null (NaN) statistics, and a producer's own kind."""
    steps: list[list[E.Event]] = []
    for s in range(num_steps):
        width = 20_000 if s == 150 else s
        evs: list[E.Event] = [E.Read(t=s, step=s, seq=s % 3, blocks=list(range(width)), versions=[s] * width)]
        evs += [E.Attn(t=s, step=s, seq=s % 3, layer=layer, entropy=2.0, sink=0.25, nonfinite=0,
                       max_logit=float("nan") if s % 17 == 3 and layer == 1 else 1.5) for layer in range(16)]
        if s % 29 == 5:
            evs.append(E.Unknown(kind="gpu_sync", t=s, step=s, fields={"stream": s}))
        evs.append(E.StepEnd(t=s, step=s))
        steps.append(evs)
    return steps


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.gz", "t.kvtrace.msgpack"])
def test_a_long_trace_reads_back_whole_in_bounded_batches(tmp_path, name):
    # GIVEN a trace of ~1 MB (JSON) that spans many read chunks, with a line and a frame longer than one
    steps = _long_trace()
    events = [e for step in steps for e in step]
    with TraceWriter(tmp_path / name, HEADER) as w:
        for step in steps:
            w.write_many(step)
    # WHEN read batch by batch
    reader = TraceReader(tmp_path / name)
    batches = list(reader.batches())
    got = [e for b in batches for e in b][:-1]
    # THEN every event comes back, null statistics as NaN floats, unknown kinds kept
    assert [E.to_dict(e) for e in got] == [E.to_dict(e) for e in events]
    nans = [e for e in got if type(e) is E.Attn and e.max_logit != e.max_logit]
    assert len(nans) == sum(1 for s in range(300) if s % 17 == 3)
    assert sum(type(e) is E.Unknown for e in got) == sum(1 for s in range(300) if s % 29 == 5)
    # AND no batch holds more than a small part of the trace: memory stays bounded by the batch, not the file
    assert max(map(len, batches)) < len(events) / 5
    assert reader.closed and not reader.truncated


@pytest.mark.parametrize("gz", [False, True])
def test_a_corrupt_line_deep_in_a_long_trace_is_named_by_its_number(tmp_path, gz):
    # GIVEN a long trace with blank lines and, far past the first read chunks, one bad line
    plain = tmp_path / "ok.kvtrace"
    with TraceWriter(plain, HEADER) as w:
        for step in _long_trace():
            w.write_many(step)
    lines = plain.read_bytes().split(b"\n")
    lines[40:40] = [b"", b"   "]
    bad = len(lines) - 30
    lines[bad] = b'{"kind":"write","t":1,"step":1,"block":"oops"}'
    data = b"\n".join(lines)
    path = tmp_path / ("bad.kvtrace.gz" if gz else "bad.kvtrace")
    path.write_bytes(gzip.compress(data) if gz else data)
    # WHEN read THEN the error names the file and the 1-based number of that line
    with pytest.raises(TraceFormatError) as err:
        list(TraceReader(path))
    assert err.value.line == bad + 1 and str(path) in str(err.value)


def test_null_statistics_from_other_producers_read_back_as_nan(tmp_path):
    # GIVEN a JSON line written by hand and a msgpack frame whose producer wrote nil for NaN
    line = {"kind": "attn", "t": 4, "step": 1, "seq": "a", "layer": 2, "max_logit": None, "entropy": 1.0,
            "sink": None, "nonfinite": 3, "heads_entropy": [0.5, None]}
    header = msgspec.msgpack.encode(HEADER)
    frame = msgspec.msgpack.encode([line, {"kind": "step_end", "t": 5, "step": 1}])
    packed = tmp_path / "nil.kvtrace.msgpack"
    packed.write_bytes(b"kvdoctor-trace msgpack 1\n" + len(header).to_bytes(4, "little") + header
                       + len(frame).to_bytes(4, "little") + frame)
    plain = tmp_path / "null.kvtrace"
    plain.write_bytes(E.encode(HEADER) + b"\n" + msgspec.json.encode(line) + b"\n")
    for path in (plain, packed):
        # WHEN read THEN the statistics are NaN floats and the rest is as written
        ev = next(iter(TraceReader(path)))
        assert type(ev) is E.Attn and (ev.seq, ev.layer, ev.entropy, ev.nonfinite) == ("a", 2, 1.0, 3)
        assert all(math.isnan(v) for v in (ev.max_logit, ev.sink, ev.heads_entropy[1]))
        assert ev.heads_entropy[0] == 0.5


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.msgpack"])
def test_follow_catches_up_on_a_long_trace_chunk_by_chunk(tmp_path, name):
    # GIVEN a long trace already written and closed before the follower starts
    steps = _long_trace()
    with TraceWriter(tmp_path / name, HEADER) as w:
        for step in steps:
            w.write_many(step)
    # WHEN followed THEN every event arrives, in batches no larger than the reader's, and it ends at the close
    follower = follow(tmp_path / name, poll_s=0.01)
    batches = [b for b in follower.batches() if b]
    got = [e for b in batches for e in b][:-1]
    assert [E.to_dict(e) for e in got] == [E.to_dict(e) for step in steps for e in step]
    assert max(map(len, batches)) < len(got) / 5
    assert follower.ended == "closed"


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.gz", "t.kvtrace.msgpack"])
@pytest.mark.parametrize("read_size", [1, 3, 5, 17, 200])
def test_any_cut_between_reads_leaves_the_events_whole(tmp_path, monkeypatch, name, read_size):
    # GIVEN a short trace with every shape of event, read a few bytes at a time, so that reads cut
    # lines, frames and the 4-byte frame lengths at every possible place
    from kvdoctor import trace

    steps = _long_trace(12)
    with TraceWriter(tmp_path / name, HEADER) as w:
        for step in steps:
            w.write_many(step)
    monkeypatch.setattr(trace, "_READ", read_size)
    # WHEN read THEN the events are exactly those written
    reader = TraceReader(tmp_path / name)
    got = list(reader)[:-1]
    assert [E.to_dict(e) for e in got] == [E.to_dict(e) for step in steps for e in step]
    assert reader.closed and not reader.truncated
