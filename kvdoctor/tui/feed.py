"""The worker behind the TUI: reads events, runs the checks over every one, publishes snapshots.

A feed runs in its own thread so the interface never waits on a trace file or on the
checks. It hands each event to the checks and to the ``Monitor`` in order, then at most
``fps`` times a second copies the monitor into a ``Snapshot`` and passes it to
``publish`` (the app posts it as a message). Frames may be skipped when the events come
faster than the screen redraws; events never are. The UI thread asks the monitor
questions (a block's history, a sequence) through ``query``, under the same lock.

``SourceFeed`` reads any ``kvdoctor.session.Source``, the interface ``kvdoctor check`` reads
through too: ``LiveFeed`` follows a trace still being written (by a workload we started, or by
another process), ``BusFeed`` takes an engine's ``Bus`` in this process. ``ReplayFeed`` plays a
finished trace with pause, step and seek, so it holds the whole trace in memory.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable, Protocol, TypeVar

from ..errors import KvdoctorError
from ..events import Header
from ..findings import Finding
from ..limits import Limits
from ..session import BusSource, FollowSource, Source, TraceSource
from .state import Monitor, Snapshot
from .workload import Workload

__all__ = [
    "Checker", "CheckerFactory", "Feed", "SourceFeed", "LiveFeed", "ReplayFeed", "BusFeed", "all_checks", "suite_factory",
]

_SLICE = 4096  # events processed per lock hold: bounds how long a UI query can wait

T = TypeVar("T")


class Checker(Protocol):
    """What the feed needs from the checks: the same calls a check makes, over all of them."""

    def observe(self, event: Any) -> Iterable[Finding] | None: ...

    def finish(self) -> Iterable[Finding] | None: ...


CheckerFactory = Callable[[Header | None], "Checker | None"]
Publish = Callable[[Snapshot], None]


def suite_factory(config: Any = None) -> CheckerFactory:
    """The checks ``kvdoctor check`` runs, with the same settings (a ``kvdoctor.config.Config``;
    default settings when None). A fresh suite per (re)start: a replay that seeks back rebuilds."""

    def make(header: Header | None) -> Checker:
        from ..config import Config

        return (config or Config()).make_suite(header.model if header is not None else None)

    return make


all_checks = suite_factory()


class Feed(threading.Thread):
    """Shared machinery: the monitor, the checks, the lock and paced publishing."""

    def __init__(self, publish: Publish, *, checker_factory: CheckerFactory | None = all_checks, fps: float = 15.0,
                 limits: Limits | None = None) -> None:
        super().__init__(name=f"kvdoctor-{type(self).__name__}", daemon=True)
        self._limits = limits  # what the monitor keeps of the past (the config's [limits])
        self._publish_cb = publish
        self._factory = checker_factory
        self._interval = 1.0 / fps
        self._last_publish = 0.0
        self._dirty = False
        self._stop_event = threading.Event()
        self.lock = threading.Lock()
        self.monitor = Monitor(limits=limits)
        self._checker: Checker | None = None
        # Adds to each finding what the workload's Python was doing (py-spy) and the memory curve.
        self._attributor: Any = None
        self.status = ""
        self.workload: Workload | None = None  # a workload kvdoctor started: its output is shown, py-spy may read it
        self.output = ""  # what the workload printed last
        self._log_size = -1
        self.failed: str | None = None  # set when the source could not be read at all
        # Set while the feed has nothing to do until it is told (a replay waiting for a key, a
        # finished live source): what tests and scripts wait for before reading the screen.
        self.settled = threading.Event()
        self.last_serial = 0  # of the newest snapshot published

    # ---- for the UI thread ------------------------------------------------------------

    def query(self, fn: Callable[[Monitor], T]) -> T:
        """Run ``fn`` on the monitor while the worker holds still (a few milliseconds at most)."""
        with self.lock:
            return fn(self.monitor)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            self._run()
        except KvdoctorError as exc:
            self._fail(str(exc))
        except Exception as exc:  # a bug of ours: say so on screen and keep what was shown
            self._fail(f"kvdoctor's worker stopped: {type(exc).__name__}: {exc} (please report this)")
        finally:
            self.settled.set()

    # ---- for subclasses ---------------------------------------------------------------

    def _run(self) -> None:
        raise NotImplementedError

    def _reset(self, header: Header | None) -> None:
        with self.lock:
            self.monitor = Monitor(header, self._limits)
            self._checker = self._factory(header) if self._factory is not None else None
        self._dirty = True

    def _consume(self, events: list[Any]) -> None:
        """Every event goes to the checks, then to the monitor, then the findings it completed."""
        attributor = self._attributor
        for start in range(0, len(events), _SLICE):
            to_enrich: list[Finding] = []
            with self.lock:
                monitor = self.monitor
                observe = monitor.observe
                add = monitor.add_finding if attributor is None else to_enrich.append
                checker = self._checker
                if checker is None:
                    for ev in events[start:start + _SLICE]:
                        observe(ev)
                else:
                    check = checker.observe
                    for ev in events[start:start + _SLICE]:
                        found = check(ev)
                        observe(ev)
                        if attributor is not None:
                            attributor.observe(ev)
                        if found:
                            for f in found:
                                add(f)
            if to_enrich:
                # py-spy takes milliseconds to seconds: never while the UI may be waiting on the lock.
                enriched = [attributor.enrich(f) for f in to_enrich]
                with self.lock:
                    for f in enriched:
                        self.monitor.add_finding(f)
            self._dirty = True
            self._publish()

    def _start_attribution(self) -> None:
        """The workload is our child, so py-spy may read its stacks when a finding fires."""
        if self.workload is not None:
            from ..attribution import Attributor

            self._attributor = Attributor(pid=self.workload.pid, pyspy_timeout_s=3.0)

    def _read_output(self) -> None:
        """The end of the workload's output (the demo's answers), read again whenever its log grew."""
        if self.workload is None:
            return
        try:
            size = os.stat(self.workload.log).st_size
        except OSError:
            return
        if size != self._log_size:
            self._log_size = size
            self.output = self.workload.log_tail()
            self._dirty = True

    def _finish_checks(self, reason: str) -> None:
        with self.lock:
            if self._checker is not None:
                for f in self._checker.finish() or ():
                    self.monitor.add_finding(f)
                self._checker = None
            self.monitor.finish(reason)
        self._dirty = True

    def _set_status(self, status: str) -> None:
        self.status = status
        self._dirty = True
        self._publish(force=True)

    def _fail(self, message: str) -> None:
        self.failed = message
        self._set_status(message)

    def _snapshot(self) -> Snapshot:
        """What the screen shows now (under the lock)."""
        return self.monitor.snapshot(status=self.status, ended=self.failed, output=self.output)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_publish < self._interval:
            return
        self._read_output()  # what the workload printed since the last frame (the Output screen)
        if not self._dirty:
            return
        with self.lock:
            snap = self._snapshot()
        self._last_publish = now
        self._dirty = False
        self.last_serial = snap.serial
        self._publish_cb(snap)


class SourceFeed(Feed):
    """Any ``kvdoctor.session.Source`` (the one the checks' sessions read): a trace being written,
    a workload's trace, an engine's bus. With a ``workload``, also reports how the workload ended."""

    def __init__(
        self,
        source: Source,
        publish: Publish,
        *,
        workload: Workload | None = None,
        waiting: str | None = None,
        running: str | None = None,
        checker_factory: CheckerFactory | None = all_checks,
        fps: float = 15.0,
        limits: Limits | None = None,
    ) -> None:
        super().__init__(publish, checker_factory=checker_factory, fps=fps, limits=limits)
        self.source = source
        self.workload = workload
        self._waiting = (f"starting {workload.title}" if workload is not None
                         else waiting or f"waiting for {source.name}")
        self._running = running or f"following {source.name}"

    def stop(self) -> None:
        super().stop()
        self.source.close()

    def _run(self) -> None:
        source = self.source
        self._set_status(self._waiting)
        try:
            header = source.wait_header()
        except KvdoctorError as exc:
            self._fail(self._explain(str(exc)))
            return
        self._reset(header)
        self._start_attribution()
        self._set_status(self._running)
        try:
            for batch in source.batches():
                if batch:
                    self._consume(batch)
                else:
                    self._publish()  # a quiet source: show what the last events left
        except KvdoctorError as exc:
            self._finish_checks("trace unreadable")
            self._fail(self._explain(str(exc)))
            return
        self._finish_checks(self._end_reason())
        self._read_output()
        self._set_status(self.monitor.ended or "")

    def _end_reason(self) -> str:
        stopped = self._stop_event.is_set()
        if self.workload is not None and not stopped:
            if self.workload.wait(2.0) is None:
                # The trace is closed but the process is still tearing down: show the state meanwhile.
                self._set_status("trace closed; waiting for the workload to exit")
                while self.workload.wait(0.5) is None and not self._stop_event.is_set():
                    pass
            return self.workload.exit_message()
        return self.source.ended or "stopped"

    def _explain(self, message: str) -> str:
        if self.workload is None:
            return message
        if self.workload.wait(0.5) is None:
            return message
        return f"{self.workload.exit_message()} — {message}"


class LiveFeed(SourceFeed):
    """Follows a trace as it is written (by ``workload``, when we started it, or by another process)."""

    def __init__(self, path: str, publish: Publish, *, workload: Workload | None = None, wait_s: float = 10.0,
                 **options: Any) -> None:
        pid = workload.pid if workload is not None else None
        super().__init__(FollowSource(path, pid=pid, wait_s=wait_s), publish, workload=workload, **options)
        self.path = path


class ReplayFeed(Feed):
    """Plays a finished trace step by step; the UI steers it with ``toggle``, ``step`` and ``seek``.

    Stepping back rebuilds the state from the start of the trace (the checks only go
    forward), which is quick because nothing is drawn on the way.
    """

    def __init__(
        self,
        path: str,
        publish: Publish,
        *,
        checker_factory: CheckerFactory | None = all_checks,
        speed: float = 20.0,
        start: int | None = None,
        fps: float = 15.0,
        limits: Limits | None = None,
    ) -> None:
        super().__init__(publish, checker_factory=checker_factory, fps=fps, limits=limits)
        self.path = path
        self.speed = speed          # steps per second while playing; 0 plays as fast as possible
        self.start_step = start     # open paused after this step
        self.playing = start is None
        self._commands: queue.Queue[tuple[str, int]] = queue.Queue()
        self._events: list[Any] = []
        self._steps: list[int] = []   # distinct steps in trace order
        self._starts: list[int] = []  # index of each step's first event
        self._k = 0                   # steps fully processed
        self._finished = False
        self._header: Header | None = None
        self._truncated = False

    # ---- controls (any thread) --------------------------------------------------------

    def toggle(self) -> None:
        self._commands.put(("toggle", 0))

    def step(self, delta: int) -> None:
        self._commands.put(("step", delta))

    def seek(self, step: int) -> None:
        self._commands.put(("seek", step))

    def stop(self) -> None:
        super().stop()
        self._commands.put(("stop", 0))

    # ---- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        self._set_status(f"loading {self.path}")
        self._load()
        assert self._header is not None
        self._reset(self._header)
        if self.start_step is not None:
            self._advance_to(bisect.bisect_right(self._steps, self.start_step))
        self._show(force=True)
        while not self._stop_event.is_set():
            at_end = self._k >= len(self._steps)
            if self.playing and not at_end:
                self._advance_to(self._k + 1)
                if self._k >= len(self._steps):
                    self.playing = False  # the end: stop there, paused, with the last step shown
                self._show(force=self.speed > 0 or not self.playing)
                timeout = 1.0 / self.speed if self.speed > 0 else 0.0
            else:
                if at_end and self.playing:
                    self.playing = False
                    self._show(force=True)
                timeout = None
            if timeout is None and self._commands.empty():
                self.settled.set()
            try:
                cmd, arg = self._commands.get(timeout=timeout) if timeout != 0.0 else self._commands.get_nowait()
            except queue.Empty:
                continue
            self.settled.clear()
            self._command(cmd, arg)

    def _command(self, cmd: str, arg: int) -> None:
        if cmd == "toggle":
            self.playing = not self.playing
        elif cmd == "step":
            self.playing = False
            self._advance_to(min(max(self._k + arg, 0), len(self._steps)))
        elif cmd == "seek":
            self.playing = False
            self._advance_to(bisect.bisect_right(self._steps, arg))
        self._show(force=True)

    def _load(self) -> None:
        source = TraceSource(self.path)
        self._header = source.wait_header()
        events = self._events
        for batch in source.batches():
            events.extend(batch)
        self._truncated = source.truncated
        last = None
        for i, ev in enumerate(events):
            if ev.step != last:
                last = ev.step
                self._steps.append(last)
                self._starts.append(i)

    def _advance_to(self, k: int) -> None:
        """Make the state that of the trace after its first ``k`` steps."""
        if k < self._k:
            assert self._header is not None
            self._reset(self._header)
            self._k, self._finished = 0, False
        begin = self._starts[self._k] if self._k < len(self._steps) else len(self._events)
        end = self._starts[k] if k < len(self._steps) else len(self._events)
        self._consume(self._events[begin:end])
        self._k = k
        if k >= len(self._steps) and not self._finished:
            self._finished = True
            cut = " (last line cut short)" if self._truncated else ""
            self._finish_checks("end of trace" + cut)

    def _show(self, force: bool = False) -> None:
        total = self._steps[-1] if self._steps else 0
        at = self._steps[self._k - 1] if self._k else "-"
        state = "playing" if self.playing else "paused"
        self.status = f"replay · step {at} of {total} · {state}"
        self._dirty = True
        self._publish(force=force)


class BusFeed(SourceFeed):
    """An engine in this process, through a ``BusSource``: the engine thread pays one ``put`` per step.

    ``close(reason)`` (from any thread, once the engine is done) flushes the bus and ends the
    feed; the screen keeps the last state.
    """

    def __init__(self, bus: Any, header: Header, publish: Publish, **options: Any) -> None:
        fps = options.get("fps", 15.0)
        super().__init__(BusSource(bus, header, idle_s=1.0 / fps), publish,
                         running="watching an engine in this process", **options)

    def close(self, reason: str = "the engine stopped") -> None:
        """From the engine's thread once its work is done: the events it still buffers, then the end."""
        self.source.detach(reason)
