"""Opening a trace for reading: a file (plain, gzip or msgpack), or a stream that cannot seek.

A non-seekable input (a FIFO, a pipe such as ``/dev/stdin``, ``-`` or ``<(cat run.kvtrace)``) is read once, as its
writer sends it; ``_Stream`` keeps its first ``KEEP`` bytes so a reader can open it again after reading the
header, as it opens a file twice. ``kvdoctor.trace`` reads what these open.
"""

from __future__ import annotations

import os
import select
import stat
import zlib
from pathlib import Path
from typing import IO

from .errors import TraceError

__all__ = ["CHUNK", "KEEP", "STREAM_WAIT_S", "STDIN", "input_path", "is_stdin", "open_binary", "is_stream",
           "close_streams", "GzipStream"]

CHUNK = 1 << 20
KEEP = 1 << 20  # what a stream keeps of its start, so the reader can open it again after reading the header
STREAM_WAIT_S = 10.0  # how long a stream nothing arrives on (a FIFO no writer opened) is waited for
STDIN = "-"  # a trace path that means standard input
_GZIP_MAGIC = b"\x1f\x8b"


def input_path(path: str | os.PathLike[str]) -> Path:
    """The file a trace argument names: ``-`` is standard input."""
    return Path("/dev/stdin") if str(path) == STDIN else Path(path)


def is_stdin(path: str | os.PathLike[str]) -> bool:
    """``path`` is this process's standard input (``-``, ``/dev/stdin``, ``/proc/self/fd/0``): a TUI that
    read its trace there would get no keys."""
    try:
        mine, named = os.fstat(0), os.stat(input_path(path))
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def open_binary(path: Path) -> IO[bytes]:
    try:
        info = os.stat(path)
        f = _open_stream(path, info) if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode) else open(path, "rb")
    except FileNotFoundError:
        raise TraceError(f"no such trace file: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"{path} is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(f"cannot open trace {path}: {exc.strerror}") from None
    if isinstance(f, _StreamCursor):
        return GzipStream(f) if f.peek(2) == _GZIP_MAGIC else f  # type: ignore[return-value]
    if f.read(2) == _GZIP_MAGIC:
        f.seek(0)
        return GzipStream(f)  # type: ignore[return-value]
    f.seek(0)
    return f


class _Stream:
    """A non-seekable input read once, from its writer, as it arrives.

    The reader opens a trace more than once (its header, then its events; a format error's line number
    once more), so a stream stays open for the life of the process and keeps its first ``KEEP`` bytes
    for each new opener; a later opener that needs bytes no longer kept gets a ``TraceError``.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._f = open(fd, "rb", buffering=0)  # unbuffered: a read returns what the writer has sent so far
        self.kept = bytearray()
        self.num_read = 0
        self.keeping = True

    def close(self) -> None:
        self._f.close()

    def read_at(self, pos: int, n: int) -> bytes:
        if pos < len(self.kept):
            return bytes(self.kept[pos : pos + n])
        if pos != self.num_read:
            raise TraceError(f"{self.path} is a stream (a pipe or FIFO) that was read already; save it to a file to read it again")
        data = self._f.read(n)
        self.num_read += len(data)
        if self.keeping and len(self.kept) + len(data) <= KEEP:
            self.kept += data
        else:
            self.keeping = False
        return data


class _StreamCursor:
    """One opener's position in a ``_Stream``: a file object as the readers use one."""

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream
        self._pos = 0

    def peek(self, n: int) -> bytes:
        """The next ``n`` bytes (fewer at the end of the stream) without consuming them."""
        while self._stream.num_read < self._pos + n and self._stream.keeping:
            if not self._stream.read_at(self._stream.num_read, n):
                break
        return self._stream.read_at(self._pos, n) if self._pos < len(self._stream.kept) else b""

    def read(self, n: int = CHUNK) -> bytes:
        data = self._stream.read_at(self._pos, n if n > 0 else CHUNK)
        self._pos += len(data)
        return data

    def close(self) -> None:
        pass  # the stream stays open: another opener may come

    def __enter__(self) -> "_StreamCursor":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_streams: dict[tuple[str, int, int], _Stream] = {}


def _open_stream(path: Path, info: os.stat_result) -> _StreamCursor:
    """A cursor at the start of the stream ``path`` names, opening it the first time: without blocking on
    a FIFO no writer has opened yet, and waiting ``STREAM_WAIT_S`` for its first bytes."""
    key = (str(path), info.st_dev, info.st_ino)
    stream = _streams.get(key)
    if stream is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            _wait_readable(path, fd, info)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        stream = _streams[key] = _Stream(path, fd)
    return _StreamCursor(stream)


def close_streams() -> None:
    """Close every stream read so far, so their writers see the reader gone (EPIPE): for a long-lived
    process that reads many FIFOs (the fuzz tests); a command's streams close when it exits."""
    for stream in _streams.values():
        stream.close()
    _streams.clear()


def _wait_readable(path: Path, fd: int, info: os.stat_result) -> None:
    if os.isatty(fd):
        raise TraceError(f"{path} is a terminal: pipe a trace into it (cat run.kvtrace | kvdoctor check --trace -)")
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if not poll.poll(STREAM_WAIT_S * 1000):  # data, or a writer that came and went (end of stream)
        who = "no writer opened the FIFO" if stat.S_ISFIFO(info.st_mode) else "nothing arrived on"
        raise TraceError(f"{who} {path} in {STREAM_WAIT_S:g} s: start the program that writes the trace first")


class GzipStream:
    """Incremental gunzip that hands out every byte decompressed so far, so a stream cut short
    by a killed writer yields its whole steps and then ``EOFError`` (gzip.GzipFile loses the last read)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._buf = b""

    def _fill(self) -> bool:
        data = self._raw.read(CHUNK)
        if not data:
            if not self._z.eof:
                raise EOFError("gzip stream ended before its end-of-stream marker")
            return False
        self._buf += self._z.decompress(data)  # raises zlib.error on corrupt data
        return True

    def read(self, n: int = -1) -> bytes:
        while not self._buf and not self._z.eof:
            if not self._fill():
                break
        out, self._buf = self._buf, b""
        return out

    def readline(self) -> bytes:
        while b"\n" not in self._buf and not self._z.eof and self._fill():
            pass
        line, sep, rest = self._buf.partition(b"\n")
        self._buf = rest
        return line + sep

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> "GzipStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_stream(f: object) -> bool:
    return isinstance(f, _StreamCursor) or (isinstance(f, GzipStream) and isinstance(f._raw, _StreamCursor))
