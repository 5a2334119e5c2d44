"""A workload is all of its traces: one per cache, process, rank or instance, checked as one.

A deployment writes many traces: several caches in one process (``run.kvtrace``, ``run.2.kvtrace`` …), vLLM's engine
cores, tensor- and pipeline-parallel ranks, prefill and decode instances joined by a KV connector. ``WorkloadSession``
reads them all:

- **per trace**, every check runs in a ``CheckSuite`` of its own, as for a single trace (block ids, steps and
  sequences are a trace's own), and each finding names the trace it came from;
- **across traces**, the checks of ``kvdoctor.checks.ACROSS_CHECKS`` (ranks agreeing, a transfer's two ends) read the
  events they want of every trace in one order: by wall-clock time (``header.t0 + t``; a trace whose header has no
  ``t0`` counts from the earliest ``t0`` of the workload, or 0), ties by the trace's place in the workload, then by
  the order within the trace. A check that compares each trace only with itself step by step (ranks) is handed
  each trace's records batch by batch as they are read instead (``AcrossCheck.merged``, ``recorder``).

Memory stays bounded: a finished trace is decoded a batch at a time when the merge needs its next one (a trace still
being written, by a thread of its own ahead by at most ``_AHEAD`` batches), the driver feeds the batch that starts
earliest (a heap merge of per-trace batches, exact for finished traces), and the cross-trace events wait in a heap
only until every trace has read past them. A trace still being written that has nothing new holds the merge back for
at most ``LIVE_GRACE_S`` of wall-clock time.

Finished trace files are checked in worker processes where that helps (``run``, two or more files, more than one
CPU: ``kvdoctor.workload_pool``): a worker reads and checks a whole trace and hands back, per decoded batch, the
findings of its own checks, the records of the cross-trace checks that compare a trace with itself (the ranks
rule's per-step digests) and the events the merged ones read; the driver merges those batches as above, so the
findings and their order are those of one process. Followed traces and iteration event by event (the TUI, metrics)
are read in this process.

Sources: ``TraceSet.open(paths)`` (files, directories, globs; followed while their writers live),
``TraceSet.command(argv)`` (a workload started with ``KVDOCTOR_TRACE`` in a directory of its own, every trace file
that appears there followed). A trace that cannot be read is never skipped in silence: it is named in the report's
notes and as a ``workload/unusable-trace`` finding.
"""

from __future__ import annotations

import functools
import heapq
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import msgspec

from .checks import CheckSuite, TraceTag, make_across_suite, readers_of
from .config import Config
from .errors import TraceError
from .events import Header
from .findings import Finding
from .report import Report, apply_baseline
from .trace_set import TraceSet, trace_files
from .workload_pool import RemoteTrace, WorkerFailed, WorkerPool, available_cpus

__all__ = ["TraceSet", "WorkloadSession", "trace_files", "LIVE_GRACE_S"]

LIVE_GRACE_S = 2.0  # how long a live trace with nothing new may hold back the cross-trace merge
_AHEAD = 4  # batches a trace's reader decodes ahead of the checks
_SCAN_S = 0.25  # how often a followed directory is looked at for new traces
_END = object()


@dataclass
class _Member:
    """One trace of the workload: its source, its own checks, and a thread that reads it ahead."""

    tag: TraceTag
    source: Any
    suite: CheckSuite
    live: bool
    remote: bool = False  # checked by a worker process: ``source`` and ``suite`` are its ``RemoteTrace``
    wants: list[tuple[Any, frozenset]] = field(default_factory=list)  # merged cross-trace checks, the kinds they read
    # cross-trace checks fed this trace's records as read (not merged), each with its recorder of this trace (None:
    # the records come from the worker)
    direct: list[tuple[Any, Any]] = field(default_factory=list)
    wanted: frozenset = frozenset()  # every kind some cross-trace check reads of this trace
    t0: int = 0
    queue: "queue.Queue[Any]" = field(default_factory=lambda: queue.Queue(maxsize=_AHEAD))
    head: Any = None  # the next batch (a list of events, or a worker's ``Frame``)
    head_t: int = 0  # its first event's t
    ended: bool = False
    idle: bool = False
    last_t: int = 0  # wall-clock ns of the last event fed
    idle_since: float = 0.0
    error: Exception | None = None
    thread: threading.Thread | None = None
    _batches: Iterator[list] | None = None  # a finished trace's batches, read in the driver's thread

    def start(self) -> None:
        """A followed trace is read on a thread of its own (its follower waits for the writer); a finished one
        is read when the merge asks for its next batch (threads would only contend for the interpreter)."""
        if not self.live:
            self._batches = self.source.batches()
            return
        self.thread = threading.Thread(target=self._read, name=f"kvdoctor-read-{self.tag.index}", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for batch in self.source.batches():
                if batch:
                    self.idle = False
                    self.queue.put(batch)
                elif not self.idle:
                    self.idle, self.idle_since = True, time.monotonic()
        except Exception as exc:  # a malformed line, a vanished file: the driver names the trace
            self.error = exc
        self.queue.put(_END)

    def pull(self, block: bool) -> bool:
        """Take the next batch into ``head`` (waiting for it when ``block``); False when there is none now."""
        if self.head is not None or self.ended:
            return self.head is not None
        if self._batches is not None:
            try:
                self.head = next(b for b in self._batches if b)
                self.head_t = self.head.first_t if self.remote else self.head[0].t
            except StopIteration:
                self.ended = True
            except WorkerFailed:
                raise
            except Exception as exc:  # a malformed line, a vanished file: the driver names the trace
                self.error, self.ended = exc, True
            return self.head is not None
        try:
            item = self.queue.get(block=block, timeout=0.05 if block else None)
        except queue.Empty:
            return False
        if item is _END:
            self.ended = True
            return False
        self.head, self.head_t = item, item[0].t
        return True

class WorkloadSession:
    """Every check over every trace of a workload: per trace, and across them (see the module docstring)."""

    def __init__(self, traces: TraceSet, config: Config | None = None, *, name_traces: bool | None = None,
                 workers: int | None = None) -> None:
        self.traces = traces
        # worker processes that check finished traces in ``run`` (None: one per CPU; 1: all in this process)
        self.workers = workers
        self._pool: WorkerPool | None = None
        self._parallel = False  # this drive may hand finished traces to workers (``run``, not per event)
        self.name_traces = name_traces  # findings name their trace: always, never, or (None) when there are several
        self.config = config or Config()
        self.across = make_across_suite(disabled=self.config.disable, severity=self.config.severity,  # type: ignore[arg-type]
                                        max_per_rule=self.config.max_findings_per_rule)
        self.members: list[_Member] = []
        self.notes: list[str] = []
        self.name = traces.name
        self._found: list[tuple[int | None, Finding]] = []  # (member index or None: the workload's, finding)
        self._cross: list[tuple[int, int, int, Any]] = []  # (wall ns, trace index, order, event)
        self._order = 0
        self._stop = threading.Event()
        self._closed = False
        self.t0_base: int | None = None  # the earliest wall-clock t0 of the workload's traces (None: none says one)
        self._last_scan = 0.0
        self._unusable_named = 0  # the set's unusable traces already named
        self._handed = 0  # findings already handed out by ``new_findings``

    # ---- running ---------------------------------------------------------------------

    def run(self) -> "WorkloadSession":
        """Check every trace to its end. Finished traces (two or more, files, with more than one CPU) are checked
        in worker processes (``kvdoctor.workload_pool``), with the findings one process would give, in its order."""
        self._parallel = True
        for _ in self._drive(per_event=False):
            pass
        return self

    def __iter__(self) -> Iterator[tuple[Any, list[Finding]]]:
        """``(event, findings it completed)`` for every event, a trace's batch at a time in merged order, then
        ``(None, end findings)``."""
        for _, event, found in self._drive(per_event=True):
            yield event, found

    def tagged(self) -> Iterator[tuple[TraceTag | None, Any, list[Finding]]]:
        """As iterating, with the trace each event came from (None with the end findings)."""
        yield from self._drive(per_event=True)

    def stop(self) -> None:
        """From another thread (or a Ctrl-C handler): stop reading; the session ends as if the traces had."""
        self._stop.set()
        for m in self.members:
            m.source.close()

    def _drive(self, per_event: bool) -> Iterator[tuple[TraceTag | None, Any, list[Finding]]]:
        try:
            self._start()
            while not self._stop.is_set():
                m = self._next_member()
                if m is None:
                    if self._all_done():
                        break
                    continue
                batch, m.head = m.head, None
                yield from self._feed(m, batch, per_event)
                self._release(self._watermark())
        except KeyboardInterrupt:
            self.stop()
            raise
        finally:
            for m in self.members:
                m.source.close()
            if self._pool is not None:
                self._pool.close()
            self.traces.close()
        yield None, None, self.close()

    def _start(self) -> None:
        paths = list(self.traces.paths)
        if self.traces.child is not None or self.traces.await_first:
            paths = self._first_traces()
        pool = self._workers(paths)
        for path in paths:
            self._add(path, strict=len(paths) == 1 and self.traces.watch is None, pool=pool)
        for m in self.members:  # a trace that says no t0 counts from the earliest the others say
            if m.tag.header.t0 is None:
                m.t0 = self.t0_base or 0
        if not self.members and not self.traces.unusable and self.traces.watch is None:
            raise TraceError(f"no trace to check in {self.traces.name}")

    def _first_traces(self) -> list[str]:
        """A started workload, or a followed directory with no trace yet: wait (up to ``wait_s``) for the first
        trace, or for the workload to exit without one."""
        deadline = time.monotonic() + self.traces.wait_s
        while not self._stop.is_set():
            found = self.traces.scan()
            if found:
                return found
            child = self.traces.child
            if child is None:
                if time.monotonic() > deadline:
                    raise TraceError(f"no trace appeared in {self.traces.watch} within {self.traces.wait_s:g} s")
            elif child.returncode is not None or time.monotonic() > deadline:
                child.wait(5.0)
                found = self.traces.scan()
                if found:
                    return found
                what = child.exit_message() if child.returncode is not None else \
                    f"no trace after {self.traces.wait_s:g} s"
                self.traces.close()
                raise TraceError(f"the workload wrote no kvdoctor trace ({what}; does it build a kvdoctor engine "
                                 "or run vLLM with the plugin?)")
            time.sleep(0.05)
        return []

    def _workers(self, paths: list[str]) -> WorkerPool | None:
        """Worker processes for the finished traces among ``paths``, where they can help: checked to the end
        (``run``), two or more trace files, none followed, more than one CPU (or ``workers`` asks)."""
        workers = self.workers if self.workers is not None else available_cpus()
        if not self._parallel or workers < 2 or len(paths) < 2 or self.traces.child is not None \
                or self.traces.follow or not all(os.path.isfile(p) for p in paths):
            return None
        try:
            if any(self.traces.live(p) for p in paths):
                return None  # a trace still written is followed here; the others keep its pace
        except TraceError:
            pass  # ``_add`` names it
        self._pool = WorkerPool(min(workers, len(paths)), self.config)
        return self._pool

    def _add(self, path: str, strict: bool = False, pool: WorkerPool | None = None) -> None:
        """Open one more trace of the workload; one that cannot be opened is named, unless it is the only one."""
        try:
            source, live = self.traces.source(path)
            header = source.wait_header()
        except TraceError as exc:
            if strict:
                raise
            self._unusable(path, str(exc))
            return
        index = len(self.members)
        tag = TraceTag(index=index, name=self.traces.label(path), header=header)
        if pool is not None and not live:
            source = suite = pool.add(tag, path)
        else:
            suite = self.config.make_suite(header.model)
        m = _Member(tag=tag, source=source, suite=suite, live=live, remote=isinstance(source, RemoteTrace))
        if header.t0 is not None:
            m.t0 = header.t0
            if self.t0_base is None or header.t0 < self.t0_base:
                self.t0_base = header.t0
        else:
            m.t0 = self.t0_base or 0
        m.wants, direct = readers_of(self.across.checks, tag)
        for check in direct:
            m.direct.append((check, None if m.remote else check.recorder(tag)))
            if m.remote:
                check.reread = functools.partial(self._reread, check)
        m.wanted = frozenset().union(*(kinds for _, kinds in m.wants))
        self.members.append(m)
        self._accept(None, [f for check in self.across.checks for f in check.trace_added(tag)])
        m.start()

    def _reread(self, check: Any, tag: TraceTag) -> Iterator[list]:
        """``check``'s records of a trace a worker checked, made again here with every detail, batch by batch."""
        from .session import TraceSource

        recorder = check.recorder(tag)
        for batch in TraceSource(self.members[tag.index].source.path).batches():
            yield recorder.record(batch)
        yield recorder.end()

    def _unusable(self, path: str, why: str) -> None:
        path = self.traces.label(path)
        self.notes.append(f"trace {path} could not be used: {why}")
        self._accept(None, [Finding(check="workload", rule="unusable-trace", severity="error", trace=path,
                                    message=f"a trace of the workload could not be read, so it was not checked: {why}",
                                    evidence={"path": path})], across=False)

    def _next_member(self) -> _Member | None:
        """The trace whose next batch starts earliest, once every trace that may still have an earlier one
        has shown its next batch (a live trace with nothing new is not waited for)."""
        self._discover()
        waiting = False
        for m in self.members:
            if m.head is None and not m.ended and not m.pull(block=False):
                if m.ended:
                    self._ended(m)
                elif not (m.live and m.idle):
                    waiting = True
        if waiting:
            # a trace still decoding may hold an earlier batch: wait for each (briefly, then look again)
            for slow in [m for m in self.members if m.head is None and not m.ended and not (m.live and m.idle)]:
                if not slow.pull(block=True):
                    if slow.ended:
                        self._ended(slow)
                    return None
        ready = [m for m in self.members if m.head is not None]
        if not ready:
            time.sleep(0.01)
            return None
        return min(ready, key=lambda m: (m.t0 + m.head_t, m.tag.index))

    def _discover(self) -> None:
        if self.traces.watch is None or time.monotonic() - self._last_scan < _SCAN_S:
            return
        self._last_scan = time.monotonic()
        for path in self.traces.scan():
            self._add(path)
        for path, why in self.traces.unusable[self._unusable_named:]:
            self._unusable(path, why)
        self._unusable_named = len(self.traces.unusable)

    def _all_done(self) -> bool:
        if not all(m.ended for m in self.members):
            return False
        if self.traces.running():
            time.sleep(0.05)  # the workload may still open another trace
            return False
        self._last_scan = 0.0
        before = len(self.members)
        self._discover()  # a trace opened just before the workload exited
        return len(self.members) == before and all(m.ended for m in self.members)

    def _feed(self, m: _Member, batch: Any, per_event: bool) -> Iterator[tuple[TraceTag, Any, list[Finding]]]:
        index, tag = m.tag.index, m.tag
        if m.remote:  # a worker's frame of a batch: what the batch's events would have given here
            self._accept(index, batch.found)
            for (check, _), records in zip(m.direct, batch.direct):
                self._accept(None, check.see_records(tag, records))
            m.last_t = m.t0 + batch.last_t
            self._merge(m, batch.cross)
            return
        if per_event:
            observe = m.suite.observe
            for event in batch:
                found = self._accept(index, observe(event))
                yield tag, event, [self._named(index, f) for f in found] if found else found
        else:
            found = m.suite.observe_many(batch)
            if found:
                self._accept(index, found)
        for check, recorder in m.direct:
            self._accept(None, check.see_records(tag, recorder.record(batch)))
        m.last_t = m.t0 + batch[-1].t
        wanted = m.wanted
        if wanted:
            self._merge(m, [e for e in batch if type(e) in wanted])

    def _merge(self, m: _Member, events: list) -> None:
        """Events of ``m`` that merged cross-trace checks read wait in the heap for every trace to pass them."""
        t0, index, cross, order = m.t0, m.tag.index, self._cross, self._order
        for event in events:
            order += 1
            heapq.heappush(cross, (t0 + event.t, index, order, event))
        self._order = order

    def _watermark(self) -> tuple[int, int]:
        """Cross-trace events before this (wall ns, trace index) can no longer be preceded by one unread."""
        now_ns = time.time_ns()
        bound: tuple[int, int] | None = None
        for m in self.members:
            if m.ended:
                continue
            if m.head is not None:
                t = m.t0 + m.head_t
            elif m.live and m.idle and time.monotonic() - m.idle_since > LIVE_GRACE_S:
                t = max(m.last_t, now_ns - int(LIVE_GRACE_S * 1e9))
            else:
                t = m.last_t
            if bound is None or (t, m.tag.index) < bound:
                bound = (t, m.tag.index)
        return bound if bound is not None else (1 << 62, 0)

    def _release(self, upto: tuple[int, int]) -> None:
        cross = self._cross
        while cross and (cross[0][0], cross[0][1]) < upto:
            _, index, _, event = heapq.heappop(cross)
            tag = self.members[index].tag
            if event is None:
                self._accept(None, [f for check in self.across.checks if check.merged for f in check.trace_ended(tag)])
                continue
            for check, kinds in self.members[index].wants:
                if type(event) in kinds:
                    self._accept(None, check.see(tag, event))

    def _ended(self, m: _Member) -> None:
        """A trace ended: its end-of-trace rules, and what its reader could not read."""
        if m.error is not None:
            if len(self.members) == 1 and self.traces.watch is None:
                raise m.error
            self._unusable(m.tag.name, f"{m.error} (its events before that were checked)")
        self._accept(m.tag.index, m.suite.finish())
        ends = m.source.end.direct if m.remote and m.source.end is not None else \
            [recorder.end() if recorder is not None else [] for _, recorder in m.direct]
        for (check, _), records in zip(m.direct, ends):
            self._accept(None, check.see_records(m.tag, records, ended=True))
        for note in m.source.notes:
            self.notes.append(f"{m.tag.name}: {note}" if len(self.members) > 1 else note)
        # the trace's end joins the merge after its last event, so the rules across traces see it in order
        self._order += 1
        heapq.heappush(self._cross, (m.last_t, m.tag.index, self._order, None))
        self._release(self._watermark())

    def _accept(self, index: int | None, found: Any, across: bool = True) -> list[Finding]:
        if not found:
            return []
        if index is None and across:
            found = self.across.add(found)
        self._found.extend((index, f) for f in found)
        return list(found)

    # ---- ending ----------------------------------------------------------------------

    def close(self) -> list[Finding]:
        """Every trace's end-of-trace rules (those not ended yet: a stop), then the cross-trace ones (once)."""
        if self._closed:
            return []
        self._closed = True
        before = len(self._found)
        for m in self.members:
            if not m.ended:
                m.ended = True
                self._accept(m.tag.index, m.suite.finish())
        self._release((1 << 62, 0))
        self._accept(None, self.across.finish())
        return [self._named(i, f) for i, f in self._found[before:]]

    def add(self, findings: list[Finding]) -> None:
        """Findings about the workload itself (its exit status)."""
        self._accept(None, findings, across=False)

    def new_findings(self) -> list[Finding]:
        """The findings since the last call, per trace and across traces, each naming its trace: what a live
        view adds as the workload goes on (iterating yields only a trace's own findings with its events)."""
        start, self._handed = self._handed, len(self._found)
        return [self._named(i, f) for i, f in self._found[start:]]

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far; each names its trace when the workload has several."""
        return [self._named(i, f) for i, f in self._found]

    def _named(self, index: int | None, f: Finding) -> Finding:
        """``f`` naming the trace it came from, where findings do (see ``name_traces``)."""
        if index is None or f.trace is not None:
            return f
        named = self.name_traces if self.name_traces is not None else (
            len(self.members) > 1 or bool(self.traces.unusable))
        return msgspec.structs.replace(f, trace=self.members[index].tag.name) if named else f

    @property
    def num_events(self) -> int:
        return sum(m.suite.num_events for m in self.members)

    @property
    def header(self) -> Header | None:
        return self.members[0].tag.header if self.members else None

    def report(self, *, fail_on: str | None = None, baseline: Any = None) -> Report:
        findings, baselined = self.findings, 0
        if baseline is not None:
            findings, baselined = apply_baseline(findings, baseline)
        one = len(self.members) == 1 and not self.traces.unusable
        notes = list(self.notes)
        if self.traces.child is not None:
            notes.append(self.traces.exit_message())
        if len(self.members) > 1:
            notes.insert(0, f"{len(self.members)} traces: " + ", ".join(
                f"{m.tag.name} ({m.tag.who})" if m.tag.who != m.tag.name else m.tag.name for m in self.members))
        return Report(
            findings, fail_on=fail_on or self.config.fail_on, source=self.name,
            trace_path=self.members[0].tag.name if one else None, num_events=self.num_events,
            truncated=any(m.source.truncated for m in self.members),
            suppressed=sum(m.suite.suppressed for m in self.members) + self.across.suppressed,
            baselined=baselined, notes=notes,
        )
