"""Sessions: one source of events wired to the checks, with the findings so far.

A source is where events come from — a finished trace, a trace another process is still
writing, a workload we start with ``KVDOCTOR_TRACE`` set, or an engine ``Bus`` in this
process. A ``Session`` pulls from a source and runs every check on every event:

    session = Session(open_source(path), config)
    for event, new in session:           # the last item is (None, what only the end shows)
        ...
    report = session.report()

or, with no loop of one's own, ``session.run()``. The TUI's worker reads the same sources
(``kvdoctor.tui.feed.SourceFeed``), so a trace, a workload or a bus looks the same to the checks
on screen and in ``kvdoctor check``. For an engine in this process, ``Session.on_bus(bus)``
checks the events synchronously at every step end (the pytest plugin and the live-cost
benchmark use it); ``BusSource`` instead queues them for a consumer thread.
"""

from __future__ import annotations

import os
import queue
import shlex
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Protocol

from .checks import AttentionCheck
from .child import TracedChild
from .config import Config
from .errors import TraceError, UsageError
from .events import Event, Header, Unknown
from .findings import Finding
from .report import Report, apply_baseline

__all__ = [
    "Source", "TraceSource", "FollowSource", "CommandSource", "BusSource", "Session", "open_source",
]

_STOP = object()  # ends a BusSource's queue


class Source(Protocol):
    """Where events come from: the one interface the checks (``Session``), the TUI's worker
    (``kvdoctor.tui.feed.SourceFeed``), metrics and reports read through.

    ``batches`` yields lists of events, an empty one on each idle wait so that a consumer may
    look up (draw a frame, notice a stop). ``ended`` says, once ``batches`` is done, why in words.
    ``close`` may come from another thread: the stream then ends as if the source had.
    """

    name: str
    trace_path: str | None
    truncated: bool
    notes: list[str]

    @property
    def ended(self) -> str | None: ...

    def wait_header(self) -> Header | None: ...

    def batches(self) -> Iterator[list[Any]]: ...

    def close(self) -> None: ...


class TraceSource:
    """A finished (or killed) trace file, read in bounded memory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from .trace import TraceReader

        self.name = self.trace_path = str(path)
        self._reader = TraceReader(path)
        self.notes: list[str] = []

    @property
    def truncated(self) -> bool:
        return self._reader.truncated

    @property
    def ended(self) -> str:
        return "end of trace" + (" (last line cut short)" if self._reader.truncated else "")

    def wait_header(self) -> Header:
        return self._reader.header

    def batches(self) -> Iterator[list[Any]]:
        yield from self._reader.batches()
        if self._reader.truncated:
            self.notes.append("the trace's last line was cut short (killed writer); everything before it was checked")

    def close(self) -> None:
        pass


class FollowSource:
    """A trace another process is still writing: tail it until it closes or its writer is gone."""

    def __init__(self, path: str | os.PathLike[str], *, pid: int | None = None, wait_s: float = 10.0,
                 poll_s: float = 0.05) -> None:
        from .trace import follow

        self.name = self.trace_path = str(path)
        self.stop_event = threading.Event()
        self._follower = follow(path, stop=self.stop_event, pid=pid, wait_s=wait_s, poll_s=poll_s)
        self.notes: list[str] = []

    @property
    def truncated(self) -> bool:
        return self._follower.truncated

    @property
    def ended(self) -> str | None:
        how = self._follower.ended
        if how == "closed":
            return "trace closed by its writer"
        if how == "writer-gone":
            return "the writing process is gone" + (" (last line cut short)" if self.truncated else "")
        return how

    def wait_header(self) -> Header:
        return self._follower.wait_header()

    def batches(self) -> Iterator[list[Any]]:
        yield from self._follower.batches()
        if self._follower.ended == "writer-gone":
            self.notes.append("the writing process is gone without closing its trace"
                              + (" (last line cut short)" if self._follower.truncated else ""))

    def close(self) -> None:
        self.stop_event.set()


class CommandSource:
    """A workload we start with ``KVDOCTOR_TRACE`` pointing at a fresh file, checked as it runs.

    Its standard output goes to our standard error, so a report on our standard output
    stays machine-readable. ``returncode`` is set once it exited.
    """

    def __init__(self, argv: list[str], *, fault: str | None = None, wait_s: float = 3600.0,
                 env: dict[str, str] | None = None) -> None:
        if not argv:
            raise UsageError("no workload command given: use `kvdoctor check -- python my_script.py`")
        self.name = shlex.join(argv)
        self._dir = tempfile.TemporaryDirectory(prefix="kvdoctor-check-")
        self.trace_path = str(Path(self._dir.name) / "workload.kvtrace")
        try:
            self._child = TracedChild(argv, self.trace_path, fault=fault, env=env, stdout=_stderr_fd())
        except UsageError:
            self._dir.cleanup()
            raise
        self._follow = FollowSource(self.trace_path, pid=self._child.pid, wait_s=wait_s)
        self.notes: list[str] = []

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    @property
    def truncated(self) -> bool:
        return self._follow.truncated

    @property
    def ended(self) -> str | None:
        return self.exit_message() if self.returncode is not None else self._follow.ended

    def wait_header(self) -> Header:
        try:
            return self._follow.wait_header()
        except TraceError as exc:
            self._child.wait(5.0)
            raise TraceError(f"{exc} ({self.exit_message()}; does it build a kvdoctor engine?)") from None

    def batches(self) -> Iterator[list[Any]]:
        yield from self._follow.batches()
        if not self._follow.stop_event.is_set():
            # The trace is closed or its writer gone: the workload's exit status is part of
            # the result, so wait for it (Ctrl-C stops waiting).
            self._child.wait()
        self.notes.extend(self._follow.notes)
        self.notes.append(self.exit_message())

    def exit_message(self) -> str:
        return self._child.exit_message()

    def close(self) -> None:
        """Stop following; a workload still running is interrupted, then terminated."""
        self._follow.close()
        self._child.stop()
        self._dir.cleanup()


def _stderr_fd() -> int | None:
    """Our standard error's descriptor, or None (inherit) where it has none (captured output)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class BusSource:
    """An engine ``Bus`` in this process, queued for a consumer on another thread.

    The engine thread only appends each step's batch to a queue (subscribed at once, so no
    event is missed); ``batches`` hands them out, an empty batch after each ``idle_s`` without
    one. The engine's thread ends the stream with ``detach(reason)`` once its work is done (it
    flushes the bus, which only that thread may touch); ``close()``, from any thread, ends it at
    once and drops what the engine still hands over until it detaches.
    """

    def __init__(self, bus: Any, header: Header | None = None, *, name: str = "engine bus",
                 idle_s: float = 0.1) -> None:
        self.name = name
        self.trace_path = None
        self.truncated = False
        self.notes: list[str] = []
        self.ended: str | None = None
        self._bus = bus
        self._header = header
        self._idle_s = idle_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        bus.subscribe(self._put)

    def _put(self, batch: list[Any]) -> None:
        if self.ended is None:
            self._queue.put(batch)

    def wait_header(self) -> Header | None:
        return self._header

    def batches(self) -> Iterator[list[Any]]:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                yield []
                continue
            if item is _STOP:
                return
            yield item

    def detach(self, reason: str = "the engine stopped") -> None:
        """From the engine's thread, its work done: flush the bus into the stream, unsubscribe, end it."""
        if self._bus is None:
            return
        bus, self._bus = self._bus, None
        bus.unsubscribe(self._put)  # flushes what the bus still buffers into the queue
        self.close(reason)

    def close(self, reason: str = "stopped") -> None:
        """End the stream now (any thread; safe to call twice: the first reason stays)."""
        if self.ended is None:
            self.ended = reason
            self._queue.put(_STOP)


def open_source(path: str | os.PathLike[str], *, follow: bool | None = None, wait_s: float = 10.0) -> Source:
    """A trace file as a source: followed while its writer is alive (or when ``follow``), read
    whole otherwise."""
    from .trace import read_header

    p = Path(path)
    if follow is None:
        if not p.exists():
            raise TraceError(f"trace {p} does not exist")
        header = read_header(p)
        follow = header.pid is not None and header.pid != os.getpid() and _writer_alive(p, header.pid)
    return FollowSource(p, wait_s=wait_s) if follow else TraceSource(p)


def _writer_alive(path: Path, pid: int) -> bool:
    """The header's pid is alive and still holds the file open (a reused pid does not)."""
    from .trace import _pid_alive

    if not _pid_alive(pid):
        return False
    fd_dir = Path(f"/proc/{pid}/fd")
    if not fd_dir.is_dir():
        return True  # no /proc: trust the pid
    target = path.resolve()
    try:
        return any(_same(fd, target) for fd in fd_dir.iterdir())
    except PermissionError:
        return True


def _same(fd: Path, target: Path) -> bool:
    try:
        return Path(os.readlink(fd)) == target
    except OSError:
        return False


class Session:
    """Every check over one source; ``findings`` grows as events are judged."""

    def __init__(self, source: Source | None = None, config: Config | None = None) -> None:
        self.source = source
        self.config = config or Config()
        self.suite = self.config.make_suite()
        self.header: Header | None = None
        self.findings: list[Finding] = self.suite.findings
        self._closed = False
        self._bus: Any = None

    # ---- pull: a source --------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Event | Unknown | None, list[Finding] | tuple]]:
        """``(event, findings it completed)`` for every event, then ``(None, end findings)``."""
        source = self._need_source()
        observe = self.suite.observe
        try:
            self._use_header(source.wait_header())
            for batch in source.batches():
                for event in batch:
                    yield event, observe(event)
        finally:
            source.close()
        yield None, self.close()

    def run(self) -> "Session":
        """Check the whole source (to its end, or until ``stop()``)."""
        source = self._need_source()
        feed = self.suite.observe_many
        try:
            self._use_header(source.wait_header())
            for batch in source.batches():
                if batch:
                    feed(batch)
        finally:
            source.close()
        self.close()
        return self

    def stop(self) -> None:
        """From another thread: stop following; the session ends as if the trace ended."""
        if self.source is not None:
            self.source.close()

    # ---- push: an engine bus in this process ------------------------------------------

    @classmethod
    def on_bus(cls, bus: Any, config: Config | None = None, header: Header | None = None) -> "Session":
        """Check ``bus``'s events as the engine hands them over, in the engine's thread."""
        session = cls(None, config)
        session._use_header(header)
        session._bus = bus
        bus.subscribe(session.feed)
        return session

    def _use_header(self, header: Header | None) -> None:
        """The trace's header is known: judge attention against the profile of its model (config's choice)."""
        self.header = header
        if header is not None and header.model:
            profile = self.config.attention_profile_for(header.model)
            for check in self.suite.checks:
                if isinstance(check, AttentionCheck) and profile is not None:
                    check.use_profile(profile)

    def feed(self, events: list[Any]) -> list[Finding]:
        """Judge a batch of events (a ``Bus`` sink); returns the findings it completed."""
        return self.suite.observe_many(events)

    # ---- ending --------------------------------------------------------------------------

    def close(self) -> list[Finding]:
        """End of the stream: flush and detach a bus, then the end-of-trace rules (once)."""
        if self._closed:
            return []
        if self._bus is not None:
            self._bus.unsubscribe(self.feed)  # flushes what the bus still buffers into feed
            self._bus = None
        self._closed = True
        return self.suite.finish()

    @property
    def num_events(self) -> int:
        return self.suite.num_events

    def counts(self) -> dict[str, int]:
        out = {"error": 0, "warning": 0, "info": 0}
        for f in self.findings:
            out[f.severity] += 1
        return out

    def report(self, *, fail_on: str | None = None, baseline: Any = None) -> Report:
        """The findings so far as a ``Report``; ``baseline`` (finding keys) drops accepted ones."""
        findings, baselined = list(self.findings), 0
        if baseline is not None:
            findings, baselined = apply_baseline(findings, baseline)
        source = self.source
        return Report(
            findings, fail_on=fail_on or self.config.fail_on,
            source=source.name if source is not None else "engine bus",
            trace_path=source.trace_path if source is not None else None,
            num_events=self.num_events, truncated=bool(source and source.truncated),
            suppressed=self.suite.suppressed, baselined=baselined,
            notes=list(source.notes) if source is not None else [],
        )

    def _need_source(self) -> Source:
        if self.source is None:
            raise RuntimeError("this session has no source: it is fed by a bus (feed/close)")
        return self.source
