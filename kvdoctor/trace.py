"""Trace files: the JSON Lines form of the event stream, written live and read back in bounded memory.

The writer flushes at every step boundary, so a killed workload loses at most the step it was in.
The reader decodes whole chunks with one msgspec call (the fast path) and only walks line by line
when a chunk holds something unusual: a kind this version does not know, or a corrupt line, whose
number it then reports. ``follow`` tails a trace that another process is still writing.
A non-seekable input (a FIFO, a pipe such as ``/dev/stdin``, ``-`` or ``<(cat run.kvtrace)``) is read
as a stream: see ``kvdoctor.trace_input``.
"""

from __future__ import annotations

import gzip
import os
import re
import threading
import time
import zlib
from pathlib import Path
from typing import IO, Iterator

import msgspec

from . import binary_trace
from .errors import IncompatibleTraceError, TraceError, TraceFormatError
from .events import FORMAT, Event, Header, StepEnd, TraceEnd, Unknown, decode, decode_lines, encode, encode_lines
from . import trace_input
from .trace_input import CHUNK, STDIN, GzipStream, close_streams, input_path, is_stdin, is_stream, open_binary

__all__ = ["TraceWriter", "TraceReader", "TraceFollower", "follow", "read_header", "wait_header", "input_path", "is_stdin", "close_streams", "STDIN"]

_BATCH_BYTES = 64 << 10  # lines decoded per msgspec call (a few hundred events)
_READ = 64 << 10  # a reader's chunk: small enough that its bytes are still in cache when decoded
_MAX_FRAME_EVENTS = 8192  # bounds a binary writer's memory when one step is very long
_PID_LIMIT = 1 << 22  # Linux's largest pid_max: a header's pid at or above it is no process
_header_decoder = msgspec.json.Decoder(Header)
_VERSION = re.compile(r"\d+(\.\d+)*")


class TraceWriter:
    """Append-only trace writer; usable directly as an engine ``Bus`` sink (``write_many``)."""

    def __init__(
        self, path: str | os.PathLike[str], header: Header, *, compress: bool | None = None, binary: bool | None = None
    ) -> None:
        self.path = Path(path)
        compress = self.path.suffix == ".gz" if compress is None else compress
        # run.kvtrace.msgpack: the binary encoding (see binary_trace), chosen by name so KVDOCTOR_TRACE can pick it
        self.binary = self.path.name.endswith(binary_trace.SUFFIX) if binary is None else binary
        self._pending: list[Event] = []  # binary mode: events waiting for their frame
        try:
            # Uncompressed, a step's events are one write: straight to the file, with no buffer to flush after
            # (the buffer's copy and flush cost 0.015 ms more a decode step, its code read cold after the weights).
            raw = open(self.path, "wb", buffering=CHUNK if compress else 0)
        except OSError as exc:
            raise TraceError(f"cannot create trace {self.path}: {exc.strerror}") from None
        # Level 1: a trace is written while inference runs; speed matters more than the last few percent of size.
        self._f: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) if compress else raw
        self._raw = raw
        self._last_step = 0
        self._last_t = 0
        self.closed = False
        self._put(binary_trace.encode_header(header) if self.binary else encode(header) + b"\n")
        self._flush()

    def write(self, event: Event) -> None:
        self.write_many([event])

    def write_many(self, events: list[Event]) -> None:
        if not events:
            return
        last = events[-1]
        # A whole step reaches the disk as soon as it is complete: what a crash loses is the step it was in.
        step_done = type(last) is StepEnd or last.step > self._last_step
        if self.binary:
            self._pending += events
            if step_done or len(self._pending) >= _MAX_FRAME_EVENTS:
                self._put_frame()
        else:
            self._put(encode_lines(events))
        if step_done:
            self._flush()
        self._last_step, self._last_t = last.step, last.t

    def close(self, reason: str = "closed") -> None:
        """Write the closing event (so a follower stops) and close; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            end = TraceEnd(t=self._last_t, step=self._last_step, reason=reason)
            if self.binary:
                self._pending.append(end)
                self._put_frame()
            else:
                self._put(encode(end) + b"\n")
            self._f.close()
            if self._f is not self._raw:
                self._raw.close()
        except OSError as exc:
            raise TraceError(f"cannot finish trace {self.path}: {exc.strerror}") from None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close("closed" if exc[0] is None else "error")

    def _put_frame(self) -> None:
        frame, self._pending = binary_trace.encode_frame(self._pending), []
        self._put(frame)

    def _put(self, data: bytes) -> None:
        try:
            done = self._f.write(data)
            while done is not None and done < len(data):  # the unbuffered file may take part of it at a time
                done += self._f.write(memoryview(data)[done:])
        except OSError as exc:  # e.g. ENOSPC: earlier steps are on disk and stay readable
            raise TraceError(f"cannot write trace {self.path}: {exc.strerror}") from None

    def _flush(self) -> None:
        try:
            self._f.flush()
            if self._f is not self._raw:
                self._raw.flush()
        except OSError as exc:
            raise TraceError(f"cannot write trace {self.path}: {exc.strerror}") from None


def _parse_header(path: Path, line: bytes) -> Header:
    try:
        header = _header_decoder.decode(line)
    except msgspec.DecodeError:
        raise IncompatibleTraceError(f"{path} is not a kvdoctor trace: line 1 is not a trace header") from None
    return _check_version(path, header)


def _check_version(path: Path, header: Header) -> Header:
    if header.format != FORMAT:
        raise IncompatibleTraceError(f"{path} is not a kvdoctor trace: format is {header.format!r}")
    if not _VERSION.fullmatch(header.version):
        raise IncompatibleTraceError(
            f"{path} has a malformed format version {header.version!r} in its header (a version is MAJOR.MINOR, e.g. 1.0)"
        )
    major = header.version.split(".", 1)[0]
    if major != "1":
        raise IncompatibleTraceError(
            f"{path} is trace format version {header.version}; this kvdoctor reads 1.x (upgrade kvdoctor to read it)"
        )
    return header


def _decode_chunk(path: Path, buf: bytes, offset: int, first_line: int | None = None) -> list[Event | Unknown]:
    """Decode complete lines; ``offset`` is where ``buf`` starts in the (uncompressed) file, ``first_line`` its
    first line's number where the reader counted them (a stream, which cannot be read again to count)."""
    try:
        return decode_lines(buf)  # type: ignore[return-value]
    except msgspec.DecodeError:
        pass  # an unknown kind, a null statistic or a bad line: line by line, to keep or name it
    out: list[Event | Unknown] = []
    for i, line in enumerate(buf.split(b"\n")):
        if not line.strip():
            continue
        try:
            out.append(decode(line))
        except msgspec.DecodeError as exc:
            first = first_line if first_line is not None else _line_at(path, offset)
            raise TraceFormatError(str(path), first + i, f"malformed event: {exc}") from None
    return out


def _line_at(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset``.

    Counted only when an error needs it, by reading the file again: counting newlines as the
    reader goes took a tenth of its time.
    """
    line = 1
    try:
        with open_binary(path) as f:
            while offset > 0:
                data = f.read(_READ)[:offset]  # the gzip stream may hand out more than asked
                if not data:
                    break
                line += data.count(b"\n")
                offset -= len(data)
    except (OSError, EOFError, zlib.error, TraceError):
        pass  # the file changed since: the count so far is the best there is
    return line


class _LineSplitter:
    """Turns arbitrary byte chunks into decoded events, keeping the unfinished tail and the offset
    that a format error turns into a line number.

    ``split`` decodes about ``_BATCH_BYTES`` of lines per msgspec call and yields each batch before
    decoding the next, so a consumer works on objects still in the CPU cache; decoding a megabyte
    into one list and freeing it later costs as much again as the parsing.
    """

    def __init__(self, path: Path, offset: int, line: int | None = None) -> None:
        self.path = path
        self.offset = offset  # where in the file the next complete line starts
        self.line = line  # its number, when counted as the reader goes (a stream)
        self._parts: list[bytes] = []  # an unfinished line, possibly spread over several chunks

    def split(self, data: bytes) -> Iterator[list[Event | Unknown]]:
        end = data.rfind(b"\n")
        if end < 0:
            self._parts.append(data)  # joined once, when its newline comes
            return
        if self._parts:
            data = b"".join([*self._parts, data])
            end = data.rfind(b"\n")
        self._parts = [data[end + 1 :]] if end + 1 < len(data) else []
        pos = 0
        while pos <= end:
            stop = data.rfind(b"\n", pos, pos + _BATCH_BYTES)
            if stop < 0:  # one line longer than a batch
                stop = data.find(b"\n", pos + _BATCH_BYTES)
            chunk = data if pos == 0 and stop + 1 == len(data) else data[pos : stop + 1]
            events = _decode_chunk(self.path, chunk, self.offset, self.line)
            self.offset += len(chunk)
            if self.line is not None:
                self.line += chunk.count(b"\n")
            pos = stop + 1
            if events:
                yield events

    def finish(self) -> tuple[list[Event | Unknown], bool]:
        """At the end of the data: decode a last line that lacks only its newline; else report truncation."""
        tail, self._parts = b"".join(self._parts), []
        if not tail.strip():
            return [], False
        try:
            return [decode(tail)], False
        except msgspec.DecodeError:
            return [], True


def _start(
    path: Path, data: bytes, at_end: bool, stream: bool = False
) -> tuple[Header, _LineSplitter | binary_trace.FrameSplitter, bytes] | None:
    """Parse the header at the start of ``data``: the header, the splitter for the rest, and the rest.

    None while ``data`` is too short to hold the whole header and more may come (``at_end`` false).
    A ``stream`` has its lines counted as they are read, for the line number of a format error.
    """
    if len(data) > trace_input.KEEP and not data.startswith(binary_trace.MAGIC) and b"\n" not in data:
        raise IncompatibleTraceError(f"{path} is not a kvdoctor trace: no header line in its first {trace_input.KEEP >> 20} MiB")
    if data.startswith(binary_trace.MAGIC) or (not at_end and binary_trace.MAGIC.startswith(data)):
        found = binary_trace.split_header(path, data)
        if found is None:
            if at_end:
                raise TraceError(f"{path} ends inside its header: the writer was killed as it started")
            return None
        payload, used = found
        try:
            header = binary_trace.decode_header(payload)
        except msgspec.DecodeError:
            raise IncompatibleTraceError(f"{path} is not a kvdoctor trace: frame 0 is not a trace header") from None
        return _check_version(path, header), binary_trace.FrameSplitter(path), data[used:]
    line, newline, rest = data.partition(b"\n")
    if not newline and not at_end:
        return None
    if not line.strip():
        raise IncompatibleTraceError(f"{path} is empty, not a kvdoctor trace")
    return _parse_header(path, line), _LineSplitter(path, offset=len(line) + 1, line=2 if stream else None), rest


def _read_start(f: IO[bytes], path: Path) -> tuple[Header, _LineSplitter | binary_trace.FrameSplitter, bytes]:
    data = b""
    while True:
        try:
            more = f.read(4096)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(f"cannot read trace {path}: {exc}") from None
        data += more
        started = _start(path, data, at_end=not more, stream=is_stream(f))
        if started is not None:
            return started


def read_header(path: str | os.PathLike[str]) -> Header:
    p = input_path(path)
    with open_binary(p) as f:
        return _read_start(f, p)[0]


class TraceReader:
    """Reads a finished (or killed) trace in bounded memory.

    After iteration, ``truncated`` tells whether the last line was cut short (a killed writer)
    and ``closed`` whether the writer closed the trace on purpose.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = input_path(path)
        self.header = read_header(self.path)
        self.truncated = False
        self.closed = False
        self.num_events = 0

    def batches(self) -> Iterator[list[Event | Unknown]]:
        """Events in the batches they were decoded in (a step or a few hundred events): the cheap way
        to consume a large trace. A batch is not used again by the reader, so a consumer may keep it."""
        with open_binary(self.path) as f:
            _, splitter, data = _read_start(f, self.path)
            while True:
                for events in splitter.split(data):
                    yield self._count(events)
                try:
                    data = f.read(_READ)
                except (EOFError, zlib.error, OSError):
                    # A gzip stream cut short by a killed writer: keep everything before the cut.
                    self.truncated = True
                    break
                if not data:
                    break
            last, cut = splitter.finish()
            self.truncated = self.truncated or cut
            if last:
                yield self._count(last)

    def __iter__(self) -> Iterator[Event | Unknown]:
        for batch in self.batches():
            yield from batch

    def _count(self, events: list[Event | Unknown]) -> list[Event | Unknown]:
        self.num_events += len(events)
        if type(events[-1]) is TraceEnd:
            self.closed = True
        return events


def _pid_alive(pid: int) -> bool:
    """A process ``pid`` runs. A trace's header is input: a pid no process can have (0 and -1 would
    ask about whole groups, 2**70 overflows kill) is no writer."""
    if not 0 < pid < _PID_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child that its parent has not reaped yet still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class TraceFollower:
    """Tails a trace that another process is writing, like ``tail -f``.

    Ends at the writer's closing event, when the writer process is gone (after reading what it
    left), or when ``stop`` is set. ``ended`` then says which: "closed", "writer-gone" or "stopped".
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        stop: threading.Event | None = None,
        poll_s: float = 0.05,
        wait_s: float = 10.0,
        pid: int | None = None,
    ) -> None:
        self.path = input_path(path)
        self.stop = stop or threading.Event()
        self.poll_s = poll_s
        self.wait_s = wait_s
        self.pid = pid
        self.header: Header | None = None
        self.truncated = False
        self.ended: str | None = None
        self.num_events = 0
        self._f: IO[bytes] | None = None

    def wait_header(self) -> Header:
        """Wait (up to ``wait_s``) for the writer to create the file and write its header."""
        if self.header is not None:
            return self.header
        deadline = time.monotonic() + self.wait_s
        pending = b""
        while True:
            if self._f is None and self.path.exists():
                self._f = open_binary(self.path)
                if isinstance(self._f, GzipStream):
                    raise TraceError(f"{self.path} is gzip-compressed; follow a plain .kvtrace instead")
            if self._f is not None:
                pending += self._f.read(CHUNK)
                started = _start(self.path, pending, at_end=False, stream=is_stream(self._f)) if pending else None
                if started is not None:
                    self.header, self._splitter, self._pending = started
                    if self.pid is None:
                        self.pid = self.header.pid
                    return self.header
            if self.stop.is_set():
                raise TraceError(f"stopped while waiting for {self.path}")
            if self.pid is not None and not _pid_alive(self.pid):
                raise TraceError(f"the workload exited before writing a trace to {self.path}")
            if time.monotonic() > deadline:
                what = "a trace header" if self._f is not None else "the file"
                raise TraceError(f"no trace at {self.path}: waited {self.wait_s:g} s for {what}")
            time.sleep(self.poll_s)

    def batches(self) -> Iterator[list[Event | Unknown]]:
        """Decoded events as they arrive; an empty list on each idle poll, so a consumer can look up."""
        self.wait_header()
        assert self._f is not None
        splitter = self._splitter
        data = self._pending
        try:
            while True:
                idle = True
                for events in splitter.split(data) if data else ():
                    idle = False
                    self.num_events += len(events)
                    yield events
                    if type(events[-1]) is TraceEnd:
                        self.ended = "closed"
                        return
                if not idle:
                    pass  # read on at once: the writer may be ahead of us
                elif self.stop.is_set():
                    self.ended = "stopped"
                    return
                elif self.pid is not None and not _pid_alive(self.pid):
                    rest = self._f.read(CHUNK)
                    if rest:
                        data = rest
                        continue
                    last, self.truncated = splitter.finish()
                    if last:
                        self.num_events += len(last)
                        yield last
                    self.ended = "writer-gone"
                    return
                else:
                    yield []
                    time.sleep(self.poll_s)
                data = self._f.read(CHUNK)  # bounded: a follower that starts far behind catches up chunk by chunk
        finally:
            self._f.close()

    def __iter__(self) -> Iterator[Event | Unknown]:
        for batch in self.batches():
            yield from batch


def wait_header(path: str | os.PathLike[str], wait_s: float) -> Header:
    """The header of a trace whose writer may not have created it yet: waited for up to ``wait_s``."""
    follower = follow(path, wait_s=wait_s)
    try:
        return follower.wait_header()
    finally:
        if follower._f is not None:
            follower._f.close()


def follow(
    path: str | os.PathLike[str],
    *,
    stop: threading.Event | None = None,
    poll_s: float = 0.05,
    wait_s: float = 10.0,
    pid: int | None = None,
) -> TraceFollower:
    return TraceFollower(path, stop=stop, poll_s=poll_s, wait_s=wait_s, pid=pid)
