"""Which traces make a workload: files, directories and globs as given, or the traces a started command writes.

``TraceSet`` is what ``WorkloadSession`` (``kvdoctor.workload``) reads: the traces known so far, and, where it
watches a directory (a workload we started, a followed folder, a process attached to), the traces that appear
there later (``scan``). A file seen without a whole header yet waits a few seconds; one that never gets one is
named as unusable, never skipped in silence.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .child import TracedChild
from .errors import TraceError, UsageError
from .events import Header
from .session import FollowSource, TraceSource, _stderr_fd, _writer_alive

__all__ = ["TraceSet", "trace_files"]

_SUFFIXES = (".kvtrace", ".kvtrace.gz", ".kvtrace.msgpack")


def _is_trace_name(name: str) -> bool:
    return name.endswith(_SUFFIXES)


def _order(path: str) -> tuple:
    """``run.kvtrace`` before ``run.2.kvtrace`` before ``run.10.kvtrace`` (the numbering of kvdoctor's writers)."""
    name = os.path.basename(path)
    stem = name.partition(".kvtrace")[0]
    m = re.fullmatch(r"(.*)\.(\d+)", stem)
    return (os.path.dirname(path), m.group(1), int(m.group(2))) if m else (os.path.dirname(path), stem, 1)


def trace_files(args: list[str], *, empty_dirs: bool = False) -> list[str]:
    """The trace files ``args`` name: files as given, every trace file in a directory, a glob's matches;
    in order, each once. A name that is none of these stays, so opening it says what is wrong. A directory
    without traces is an error unless ``empty_dirs`` (one followed: its traces are still to come)."""
    out: list[str] = []
    for arg in args:
        if os.path.isdir(arg):
            found = sorted((os.path.join(arg, n) for n in os.listdir(arg) if _is_trace_name(n)), key=_order)
            if not found and not empty_dirs:
                raise TraceError(f"{arg} holds no trace files (*.kvtrace, *.kvtrace.gz, *.kvtrace.msgpack)")
            out += found
        elif glob.has_magic(arg) and not os.path.exists(arg):
            found = sorted(glob.glob(arg), key=_order)
            if not found:
                raise TraceError(f"no trace matches {arg}")
            out += found
        else:
            out.append(arg)
    seen: set[str] = set()
    return [p for p in out if not (os.path.abspath(p) in seen or seen.add(os.path.abspath(p)))]


class TraceSet:
    """The traces of one workload, as they are known so far; ``scan`` finds new ones where it watches."""

    def __init__(self, name: str, *, watch: str | None = None, wait_s: float = 10.0,
                 alive: Callable[[], bool] | None = None) -> None:
        self.name = name
        self.watch = watch  # a directory whose new trace files join the workload
        self.wait_s = wait_s
        self._alive = alive  # while true, more traces may still appear in ``watch``
        self.paths: list[str] = []
        self.pending: dict[str, float] = {}  # a file seen without a whole header yet -> when first seen
        self.unusable: list[tuple[str, str]] = []
        self.child: TracedChild | None = None
        self.follow: bool | None = None
        self.await_first = False  # a followed directory with no trace yet: wait for one (up to wait_s)
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._headers: dict[str, Header] = {}  # trace path -> its header, once whole (it does not change after)

    # ---- ways to make one ------------------------------------------------------------

    @classmethod
    def open(cls, args: list[str], *, follow: bool | None = None, wait_s: float = 10.0,
             alive: Callable[[], bool] | None = None) -> "TraceSet":
        """Trace files, directories or globs; ``follow`` True follows them all, None follows each trace whose
        writer still holds it open. A directory named alone is watched unless ``follow`` is False: a trace that
        appears there while the others are read joins the workload, and after they ended while ``alive`` says
        so (e.g. ``writers_alive``: the screen, which waits for a process's next cache)."""
        paths = trace_files(args, empty_dirs=bool(follow))
        dirs = [a for a in args if os.path.isdir(a)]
        name = paths[0] if len(paths) == 1 and not dirs else (
            dirs[0] if len(args) == 1 and dirs else f"{len(paths)} traces")
        ts = cls(name, watch=dirs[0] if follow is not False and len(dirs) == 1 else None, wait_s=wait_s, alive=alive)
        ts.follow = follow
        ts.paths = paths
        ts.await_first = not paths and ts.watch is not None
        return ts

    @classmethod
    def command(cls, argv: list[str], *, fault: str | None = None, env: dict[str, str] | None = None,
                wait_s: float = 3600.0) -> "TraceSet":
        """``argv`` started with ``KVDOCTOR_TRACE`` in a fresh directory; every trace it writes there is read."""
        if not argv:
            raise UsageError("no workload command given: use `kvdoctor check -- python my_script.py`")
        tmp = tempfile.TemporaryDirectory(prefix="kvdoctor-check-")
        try:
            child = TracedChild(argv, str(Path(tmp.name) / "workload.kvtrace"), fault=fault, env=env,
                                stdout=_stderr_fd())
        except UsageError:
            tmp.cleanup()
            raise
        ts = cls.of_child(child, tmp.name, name=shlex.join(argv), wait_s=wait_s)
        ts._tmp = tmp
        return ts

    @classmethod
    def of_child(cls, child: TracedChild, directory: str, *, name: str, wait_s: float) -> "TraceSet":
        """The traces of a workload kvdoctor started (``child``, its ``KVDOCTOR_TRACE`` in ``directory``, a folder
        of its own): the first, and every one it writes beside it until it exits (a second cache, another
        process), each followed. The first is waited for up to ``wait_s``, or until the child exits."""
        ts = cls(name, watch=directory, wait_s=wait_s)
        ts.child, ts.follow = child, True
        return ts

    # ---- what the session asks -------------------------------------------------------

    @property
    def returncode(self) -> int | None:
        return self.child.returncode if self.child is not None else None

    def exit_message(self) -> str:
        return self.child.exit_message() if self.child is not None else ""

    def scan(self) -> list[str]:
        """Trace files in the watched directory not seen before whose header is whole (in name order)."""
        if self.watch is None:
            return []
        try:
            names = os.listdir(self.watch)
        except OSError:
            return []
        known = set(self.paths) | {p for p, _ in self.unusable}
        new = []
        for path in sorted((os.path.join(self.watch, n) for n in names if _is_trace_name(n)), key=_order):
            if path in known:
                continue
            try:
                self.header(path)
            except TraceError as exc:
                first = self.pending.setdefault(path, time.monotonic())
                if time.monotonic() - first > min(self.wait_s, 10.0):
                    self.pending.pop(path)
                    self.unusable.append((path, str(exc)))
                continue
            self.pending.pop(path, None)
            self.paths.append(path)
            new.append(path)
        return new

    def label(self, path: str) -> str:
        """What reports call a trace: its path as given, or its file name in a started workload's own directory
        (removed once checked)."""
        return os.path.basename(path) if self.child is not None else path

    def header(self, path: str) -> Header:
        """The trace's header, read once (``scan``, ``source`` and ``writers_alive`` all want it); a
        ``TraceError`` while it is not whole yet."""
        header = self._headers.get(path)
        if header is None:
            from .trace import read_header

            header = self._headers[path] = read_header(path)
        return header

    def live(self, path: str) -> bool:
        """Whether the trace is followed: all are (``follow``), none are, or (None) those whose writer, a process
        other than this one, still holds them open."""
        if self.follow is not None:
            return self.follow
        header = self.header(path)
        return header.pid is not None and header.pid != os.getpid() and _writer_alive(Path(path), header.pid)

    def source(self, path: str) -> tuple[Any, bool]:
        """The source for one trace of the set, and whether it is followed."""
        live = self.live(path)
        if not live:
            return TraceSource(path), False
        # the follower stops with the process its header names; a trace may appear before its header (--follow).
        # One a started workload wrote without naming its writer ends with the workload (its header is whole:
        # ``scan`` found it so).
        pid = None
        if self.child is not None:
            pid = self.header(path).pid or self.child.pid
        return FollowSource(path, pid=pid, wait_s=self.wait_s, poll_s=0.02), True

    def writers_alive(self) -> bool:
        """Whether a process (other than this one) that wrote one of the traces still runs: it may write another."""
        from .trace import _pid_alive

        for path in self.paths:
            try:
                pid = self.header(path).pid
            except TraceError:
                continue  # not whole yet: its writer is asked again next time
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                return True
        return False

    def running(self) -> bool:
        """A started workload still runs (more traces may appear)."""
        if self._alive is not None:
            return self._alive()
        return self.child is not None and self.child.returncode is None

    def close(self) -> None:
        if self.child is not None:
            self.child.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
