"""A workload of several traces on one screen: one state per trace, one findings list for them all.

A deployment writes a trace per cache, process, rank or instance (``kvdoctor.workload``). ``WorkloadFeed``
reads them all through a ``WorkloadSession`` (every check per trace and across them, as ``kvdoctor check``
does) and folds each trace's events into a ``Monitor`` of its own, so the block map, tiers, attention,
memory and event log are always one trace's: block ids, steps and sequences belong to a trace. The screen
shows the trace the user picked (``select``); the findings list is merged over every trace, each finding
naming the trace it came from, and a finding marks blocks in its own trace's map only.

A workload kvdoctor started (``kvdoctor watch -- CMD``) is such a workload too: every trace it writes, in the folder
its ``KVDOCTOR_TRACE`` names, joins the screen as it appears (``TraceSet.of_child``); its output is the Output
screen's, py-spy reads its stacks when a finding fires, and the screen ends with how it exited.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from typing import Any

from ..checks import TraceTag
from ..findings import Finding
from ..limits import Limits
from .feed import Feed, Publish
from .state import Monitor, Snapshot, TraceView
from .workload import Workload

__all__ = ["WorkloadFeed", "label_of"]

_MAX_FINDINGS = 5000  # merged findings kept for the list (the counts keep going)


def label_of(tag: TraceTag) -> str:
    """A trace in a few words: who wrote it (instance, role, ranks) where its header says, else its file name."""
    who = tag.who
    if who == tag.name:
        who = os.path.basename(tag.name)
    role = tag.header.role
    return f"{who} ({role})" if role else who


class WorkloadFeed(Feed):
    """Every trace of ``session``'s workload, checked on this thread; the screen shows one trace at a time."""

    def __init__(self, session: Any, publish: Publish, *, workload: Workload | None = None, metrics: Any = None,
                 fps: float = 15.0, limits: Limits | None = None) -> None:
        super().__init__(publish, checker_factory=None, fps=fps, limits=limits)
        self.session = session
        self.workload = workload
        self._metrics = metrics  # a ``kvdoctor.metrics.CacheMetrics`` fed every event and finding, or None
        self._monitors: dict[int, Monitor] = {}  # trace index -> its state
        self._by_name: dict[str, int] = {}  # trace name -> index, to route a finding to its trace's map
        self._views: tuple[TraceView, ...] = ()
        self._shown = 0  # place in ``_views`` of the trace on screen
        self._findings: deque[Finding] = deque(maxlen=_MAX_FINDINGS)
        self._listed: tuple[Finding, ...] = ()  # the merged list as last published (one tuple while unchanged)
        self._counts = {"error": 0, "warning": 0, "info": 0}

    # ---- for the UI thread ------------------------------------------------------------

    def select(self, delta: int) -> None:
        """Show the trace ``delta`` places after the one shown (wrapping around)."""
        with self.lock:
            if not self._views:
                return
            self._shown = (self._shown + delta) % len(self._views)
            self.monitor = self._monitors[self._views[self._shown].index]
        self._dirty = True
        self._publish(force=True)

    def shows(self, trace: str | None) -> bool:
        """Whether ``trace`` (a finding's) is the one on screen: its blocks and sequences are the map's."""
        views = self._views
        return bool(views) and views[self._shown].name == trace

    def stop(self) -> None:
        super().stop()
        self.session.stop()

    # ---- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        workload, metrics = self.workload, self._metrics
        self._set_status(f"starting {workload.title}" if workload is not None else f"reading {self.session.name}")
        self._start_attribution()
        attributor = self._attributor
        running = f"following {self.session.name}"
        for tag, event, _ in self.session.tagged():
            if tag is None:
                break
            with self.lock:
                monitor = self._monitors.get(tag.index)
                if monitor is None:
                    monitor = self._add_trace(tag)
                monitor.observe(event)
                found = self.session.new_findings()
                if found and attributor is None:
                    self._take_findings(found)
            if attributor is not None:
                attributor.observe(event)
                if found:  # py-spy takes milliseconds to seconds: never while the UI may wait on the lock
                    enriched = [attributor.enrich(f) for f in found]
                    with self.lock:
                        self._take_findings(enriched)
            if metrics is not None:
                metrics.observe(event)
                if found:
                    metrics.add_findings(found)
            self._dirty = True
            if self.status != running:
                self._set_status(running)
            self._publish()
        with self.lock:
            self._take_findings(self.session.new_findings())
            ended = self._end_reason()
            for monitor in self._monitors.values() or (self.monitor,):
                monitor.finish(ended)
        self._dirty = True
        self._set_status(ended)

    def _end_reason(self) -> str:
        if self._stop_event.is_set():
            return "stopped"
        ended = self.workload.exit_message() if self.workload is not None else "end of every trace"
        unusable = self.session.traces.unusable
        return ended + (f"; {len(unusable)} unusable (see the findings)" if unusable else "")

    def _add_trace(self, tag: TraceTag) -> Monitor:
        monitor = self._monitors[tag.index] = Monitor(tag.header, self._limits)
        self._by_name[tag.name] = tag.index
        self._views = (*self._views, TraceView(index=tag.index, name=tag.name, label=label_of(tag)))
        if len(self._monitors) == 1:
            self.monitor = monitor  # the first trace is shown until the user picks another
        return monitor

    def _take_findings(self, found: list[Finding]) -> None:
        """New findings of the session: each into the merged list, and onto its own trace's state."""
        for f in found:
            self._findings.append(f)
            self._counts[f.severity] = self._counts.get(f.severity, 0) + 1
            index = self._by_name.get(f.trace) if f.trace is not None else None
            if index is not None:
                self._monitors[index].add_finding(f)
            self._listed = ()

    def _snapshot(self) -> Snapshot:
        if not self._listed and self._findings:
            self._listed = tuple(self._findings)
        return dataclasses.replace(super()._snapshot(), findings=self._listed, num_findings=dict(self._counts),
                                   traces=self._views, shown=self._shown)
