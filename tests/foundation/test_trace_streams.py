"""Traces that are not files: a FIFO, standard input (``-`` or ``/dev/stdin``), a pipe as ``<(cat t)``
names it (``/dev/fd/N``). They are read once, as they arrive; a FIFO nobody writes is a clear error in
bounded time, never a hang or a traceback."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading

import pytest

from kvdoctor import events as E
from kvdoctor import trace, trace_input
from kvdoctor.cli import main
from kvdoctor.errors import EXIT_TRACE, IncompatibleTraceError, TraceError, TraceFormatError
from kvdoctor.trace import TraceReader, TraceWriter
from kvdoctor.tui.synthetic import SyntheticWorkload



def _written(tmp_path, name: str) -> bytes:
    """A clean synthetic serving trace's bytes (40 steps of swaps, aborts and attention; about 300 KiB)."""
    work = SyntheticWorkload(num_steps=40)
    path = tmp_path / f"src-{name}"
    with TraceWriter(path, work.header()) as w:
        w.write_many(list(work.events()))
    return path.read_bytes()


def _num_lines(data: bytes) -> int:
    return data.count(b"\n")


def _fifo_fed(tmp_path, data: bytes, chunk: int = 4096) -> tuple[str, threading.Thread]:
    """A FIFO and a thread that writes ``data`` into it in small pieces, as a live writer would."""
    fifo = str(tmp_path / "t.fifo")
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb", buffering=0) as f:
            try:
                for i in range(0, len(data), chunk):
                    f.write(data[i:i + chunk])
            except BrokenPipeError:  # the reader stopped early (a mutated trace's bad line): the rest goes unread
                pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return fifo, thread


@pytest.mark.parametrize("name", ["t.kvtrace", "t.kvtrace.gz", "t.kvtrace.msgpack"])
def test_a_fifo_is_read_as_a_stream(tmp_path, name):
    # GIVEN a trace fed through a FIFO by a writer that sends it a piece at a time
    data = _written(tmp_path, name)
    fifo, writer = _fifo_fed(tmp_path, data)
    # WHEN the reader reads it (its header first, then its events: the stream is opened twice)
    reader = TraceReader(fifo)
    got = list(reader)
    writer.join(5)
    # THEN every event arrives, the closing one last
    expected = sum(1 for _ in TraceReader(tmp_path / f"src-{name}"))
    assert reader.header.model == "synthetic"
    assert len(got) == expected and isinstance(got[-1], E.TraceEnd) and reader.closed and not reader.truncated


def test_a_corrupt_line_in_a_stream_is_named_by_its_number(tmp_path):
    # GIVEN a trace whose line 500 is garbage, arriving through a FIFO (it cannot be read again to count lines)
    lines = _written(tmp_path, "t.kvtrace").split(b"\n")
    lines[499] = b"{garbage"
    fifo, writer = _fifo_fed(tmp_path, b"\n".join(lines))
    # WHEN read THEN the error names line 500
    with pytest.raises(TraceFormatError) as err:
        list(TraceReader(fifo))
    writer.join(5)
    assert err.value.line == 500


def test_a_fifo_no_writer_opens_is_a_clear_error_in_bounded_time(tmp_path, monkeypatch, capsys):
    # GIVEN a FIFO nobody writes, and a short wait
    fifo = tmp_path / "nobody.fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(trace_input, "STREAM_WAIT_S", 0.2)
    # WHEN check and info read it THEN each says so in one line and exits 3 instead of waiting forever
    for argv in (["info", str(fifo)], ["check", "--trace", str(fifo)]):
        assert main(argv) == EXIT_TRACE
        err = capsys.readouterr().err
        assert "no writer opened the FIFO" in err and "0.2 s" in err and len(err.splitlines()) == 1


def _kvdoctor(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, timeout=60, **kw)


@pytest.mark.parametrize("source", ["-", "/dev/stdin"])
def test_check_reads_a_trace_piped_on_standard_input(tmp_path, source):
    # GIVEN a clean gzip trace piped in, as `zcat t | kvdoctor check --trace -` would
    data = gzip.compress(_written(tmp_path, "t.kvtrace"))
    # WHEN checked THEN it is read whole: exit 0, no finding
    done = _kvdoctor(["check", "--trace", source], input=data)
    assert done.returncode == 0, done.stderr.decode()
    assert b"0 errors" in done.stdout


def test_info_reads_a_process_substitution(tmp_path):
    # GIVEN the pipe bash's <(cat t) passes: a path /dev/fd/N to a pipe the command inherits
    data = _written(tmp_path, "t.kvtrace")
    read_end, write_end = os.pipe()
    feeder = threading.Thread(target=lambda: (os.write(write_end, data), os.close(write_end)), daemon=True)
    feeder.start()
    try:
        done = _kvdoctor(["info", "--json", f"/dev/fd/{read_end}"], pass_fds=[read_end])
    finally:
        os.close(read_end)
    # WHEN summarized THEN every event is counted and the trace is closed
    assert done.returncode == 0, done.stderr.decode()
    assert f'"num_events": {_num_lines(data) - 1}'.encode() in done.stdout and b'"closed": true' in done.stdout


def test_an_empty_stream_and_one_without_a_header_line_are_not_traces(tmp_path):
    # GIVEN standard input that is empty, and a character device that never ends a line
    empty = _kvdoctor(["info", "-"], stdin=subprocess.DEVNULL)
    endless = _kvdoctor(["info", "/dev/zero"])
    # THEN each is one line and exit 3, in bounded time
    assert empty.returncode == EXIT_TRACE and b"is empty" in empty.stderr
    assert endless.returncode == EXIT_TRACE and b"no header line in its first 1 MiB" in endless.stderr


def test_a_malformed_version_is_named_as_malformed_not_as_too_new(tmp_path):
    # GIVEN a header whose version is not a version
    path = tmp_path / "t.kvtrace"
    path.write_text('{"kind":"header","format":"kvdoctor-trace","version":"banana","block_size":16,'
                    '"num_layers":1,"tiers":[]}\n')
    # THEN the error says it is malformed, and does not ask for an upgrade
    with pytest.raises(IncompatibleTraceError, match="malformed format version 'banana'") as err:
        trace.read_header(path)
    assert "upgrade" not in str(err.value)


def test_a_stream_read_past_what_it_keeps_is_not_read_again(tmp_path, monkeypatch):
    # GIVEN a stream that keeps only its first 8 KiB (its header and a little more)
    monkeypatch.setattr(trace_input, "KEEP", 8192)
    fifo, writer = _fifo_fed(tmp_path, _written(tmp_path, "t.kvtrace"))
    reader = TraceReader(fifo)
    list(reader)
    writer.join(5)
    # WHEN opened again THEN a clear error, not another reader's leftovers
    with pytest.raises(TraceError, match="read already"):
        list(TraceReader(fifo))
