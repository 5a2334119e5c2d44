"""Checking a workload's finished traces in worker processes, one trace per process at a time, one per CPU.

A trace's own checks are most of the work of checking a workload, and each trace's ``CheckSuite`` is its own (block
ids, steps and sequences are a trace's), so finished traces are checked in parallel: a worker process reads and
checks one whole trace and writes, batch by batch as the trace was decoded, what the merge in
``kvdoctor.workload`` needs of it to a spill file of our own (``Frame``): the wall-clock span of the batch, the
findings it completed, the records of each cross-trace check that compares a trace with itself (``AcrossCheck
.recorder``), and the events of the kinds the merged cross-trace checks read. The parent merges these frames
exactly as it merges batches it decodes itself, so the findings and their order are the same as in one process.

What crosses the process boundary: the trace's path in (the worker opens and decodes it with msgspec, as
``kvdoctor check`` does), msgspec-encoded frames out. Trace content never goes through pickle. A worker that dies
(killed, out of memory) is an error naming its trace, never a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import struct
import tempfile
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Iterator, Union

import msgspec

from .checks import TraceTag, make_across_suite, readers_of
from .config import Config
from .errors import EXIT_TRACE, KvdoctorError, TraceError
from .events import AnyEvent
from .findings import Finding

__all__ = ["Frame", "FrameEnd", "WorkerPool", "WorkerFailed", "RemoteTrace", "available_cpus"]

_LEN = struct.Struct("<I")  # a frame's length before it


class Frame(msgspec.Struct, array_like=True, tag=0):
    """One decoded batch of a trace, as the merge needs it."""

    first_t: int  # the batch's first and last event's t (the trace's own clock)
    last_t: int
    found: list[Finding] = []  # what the trace's own checks found in it
    direct: list[list[Any]] = []  # per cross-trace check not merged (the parent's order): its records
    cross: list[AnyEvent] = []  # the events merged cross-trace checks read, in the trace's order


class FrameEnd(msgspec.Struct, array_like=True, tag=1):
    """The trace ended (or could not be read further: ``error``)."""

    num_events: int
    suppressed: int
    truncated: bool
    notes: list[str]
    found: list[Finding]  # the end-of-trace rules' findings
    direct: list[list[Any]]  # per cross-trace check not merged: the records its end completes
    error: str | None = None  # why the trace could not be read to its end (its events before were checked)


class _Crash(msgspec.Struct, array_like=True, tag=2):
    """A check raised: the worker's traceback, for the parent to raise."""

    message: str


class WorkerFailed(KvdoctorError):
    """A worker process died (killed, out of memory) or a check raised in it: the trace it checked is named."""

    exit_code = EXIT_TRACE


_decoder = msgspec.msgpack.Decoder(Union[Frame, FrameEnd, _Crash])


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or ``taskset`` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _start_method() -> str:
    """fork starts a worker in milliseconds with kvdoctor already imported, but only a process with one thread
    forks safely (another thread may hold a lock the child would wait on for ever); else a fork server, or a
    fresh interpreter where there is none."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


@dataclass(frozen=True)
class _Job:
    tag: TraceTag
    path: str
    config: Config
    out: str


def _check(job: _Job) -> None:
    """In the worker: every check of one trace, written as frames to ``job.out``."""
    from .session import TraceSource

    config, tag = job.config, job.tag
    suite = config.make_suite(tag.header.model)
    across = make_across_suite(disabled=config.disable, severity=config.severity,  # type: ignore[arg-type]
                               max_per_rule=config.max_findings_per_rule)
    merged, direct = readers_of(across.checks, tag)
    wanted = frozenset().union(*(kinds for _, kinds in merged))
    recorders = [check.recorder(tag, keep=False) for check in direct]
    encoder = msgspec.msgpack.Encoder()
    with open(job.out, "wb") as f:
        def put(frame: Any) -> None:
            data = encoder.encode(frame)
            f.write(_LEN.pack(len(data)) + data)

        try:
            source = TraceSource(job.path)
            batches = source.batches()
            error = None
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except Exception as exc:  # a malformed line, a vanished file: named as the parent would
                    error = str(exc)
                    break
                if not batch:
                    continue
                found = suite.observe_many(batch)
                put(Frame(batch[0].t, batch[-1].t, found,
                          [r.record(batch) if r is not None else [] for r in recorders],
                          [e for e in batch if type(e) in wanted] if wanted else []))
            found = suite.finish()
            put(FrameEnd(suite.num_events, suite.suppressed, source.truncated, source.notes, found,
                         [r.end() if r is not None else [] for r in recorders], error))
        except BaseException:
            put(_Crash(traceback.format_exc()))
            raise


def _end_with_parent() -> None:
    """A worker never outlives the check that started it (killed, crashed): the kernel sends it SIGKILL when its
    parent goes (Linux's parent-death signal; where there is none, a worker ends with its trace)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent went before the signal was set
        os._exit(1)


def _work(job: _Job) -> None:
    _end_with_parent()
    # Ctrl-C is the parent's to handle: it reports what was merged so far and stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _check(job)
    except BaseException:
        os._exit(1)


class WorkerPool:
    """Worker processes checking traces, at most ``workers`` at once, in the order they were added."""

    def __init__(self, workers: int, config: Config) -> None:
        self.workers = workers
        self.config = config
        self._ctx = multiprocessing.get_context(_start_method())
        self._dir = tempfile.mkdtemp(prefix="kvdoctor-workers-")
        self._queued: list[_Job] = []
        self._running: dict[int, tuple[_Job, Any]] = {}  # trace index -> (job, process)
        self._done: dict[int, int] = {}  # trace index -> the worker's exit code

    def add(self, tag: TraceTag, path: str) -> "RemoteTrace":
        job = _Job(tag, path, self.config, os.path.join(self._dir, f"{tag.index}.frames"))
        self._queued.append(job)
        self._start()
        return RemoteTrace(self, job)

    def _start(self) -> None:
        while self._queued and len(self._running) < self.workers:
            job = self._queued.pop(0)
            process = self._ctx.Process(target=_work, args=(job,), name=f"kvdoctor-check-{job.tag.index}", daemon=True)
            process.start()
            self._running[job.tag.index] = (job, process)

    def wait(self, job: _Job) -> None:
        """Until ``job``'s worker exited (starting queued ones as others end); a worker that failed raises."""
        index = job.tag.index
        while index not in self._done:
            if not self._running:
                raise WorkerFailed(f"the check of {job.tag.name} was stopped before its worker ran")
            wait([p.sentinel for _, p in self._running.values()])
            for i, (_, p) in list(self._running.items()):
                if p.exitcode is not None:
                    p.join()
                    self._done[i] = p.exitcode
                    del self._running[i]
            self._start()
        code = self._done[index]
        if code != 0:
            crash = _last_crash(job.out)
            if crash is not None:
                raise WorkerFailed(f"checking {job.tag.name} in a worker process failed:\n{crash}")
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            raise WorkerFailed(f"the worker process checking {job.tag.name} {how} (out of memory?); check that trace "
                             f"alone with `kvdoctor check --trace {job.path}`")

    def close(self) -> None:
        """Stop every worker still running and remove the spill files."""
        self._queued.clear()
        for _, p in self._running.values():
            p.kill()
            p.join()
        self._running.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


def _frames(path: str) -> Iterator[Any]:
    with open(path, "rb") as f:
        while head := f.read(_LEN.size):
            (size,) = _LEN.unpack(head)
            yield _decoder.decode(f.read(size))


def _last_crash(path: str) -> str | None:
    try:
        last = None
        for frame in _frames(path):
            last = frame
    except (OSError, msgspec.DecodeError, struct.error):
        return None
    return last.message if isinstance(last, _Crash) else None


class RemoteTrace:
    """A trace checked by a worker: its frames as ``batches`` (once the worker is done), and what its source and
    its own suite tell the merge at the end (events, findings over their cap, truncation, notes, end findings)."""

    def __init__(self, pool: WorkerPool, job: _Job) -> None:
        self.pool = pool
        self.job = job
        self.path = job.path
        self.num_events = 0
        self.suppressed = 0
        self.truncated = False
        self.notes: list[str] = []
        self.end: FrameEnd | None = None

    def batches(self) -> Iterator[Frame]:
        """The trace's frames; then its end is kept (``end``), and an error reading it is raised as a
        ``TraceError`` with the reader's words."""
        self.pool.wait(self.job)
        for frame in _frames(self.job.out):
            if type(frame) is Frame:
                yield frame
                continue
            self.end = frame
            self.num_events, self.suppressed = frame.num_events, frame.suppressed
            self.truncated, self.notes = frame.truncated, frame.notes
            if frame.error is not None:
                raise TraceError(frame.error)

    def finish(self) -> list[Finding]:
        """The trace's end-of-trace findings (none when it was stopped before its end)."""
        return list(self.end.found) if self.end is not None else []

    def close(self) -> None:
        pass
