"""Attribution: what a finding comes with besides its events — the Python code and memory around it.

A leak finding says which block leaked; attribution says who allocated what while its
sequence lived (the tracemalloc difference since the sequence started, by allocation
site), what the workload's Python threads were doing at that moment (a py-spy dump of a
workload kvdoctor started, active threads first, when the finding carries no stack recorded with
its events), and the memory curve (recent ``mem`` readings).

The ``Attributor`` is a consumer like a check: it observes events (live as a bus sink,
or from a trace) and keeps only what enrichment needs. Snapshots cost milliseconds and
memory, so one is taken at the end of a step in which sequences started, at most one per
``min_snapshot_interval_s``, and at most ``max_snapshots`` are kept; a sequence whose
snapshot was dropped is compared with the oldest one kept, and the result says so.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec

from .events import Event, Mem, SeqStart, Unknown, to_dict
from .findings import Finding
from .probes.heap import HeapProbe, HeapSnapshot, top_growth
from .probes.prober import Prober
from .probes.pyspy import PySpyError, dump_stacks

__all__ = ["Attributor"]


class Attributor:
    """Enriches findings with heap growth, a stack dump and the memory curve.

    ``heap``: the in-process heap probe (None when the workload is another process);
    ``prober``: takes a fresh ``mem`` reading when a finding fires on the engine's thread
    (from another thread, e.g. a TUI worker, its latest reading is attached instead);
    ``pid``: a workload kvdoctor started, whose stacks py-spy dumps (None for none).
    """

    def __init__(
        self,
        *,
        heap: HeapProbe | None = None,
        prober: Prober | None = None,
        pid: int | None = None,
        top: int = 10,
        num_mem: int = 16,
        max_snapshots: int = 8,
        min_snapshot_interval_s: float = 1.0,
        stacks_max_age_s: float = 1.0,
        pyspy_timeout_s: float = 10.0,
    ) -> None:
        self.heap = heap if heap is not None else (prober.heap if prober is not None else None)
        self.prober = prober
        self.pid = pid
        self.top = top
        self.max_snapshots = max_snapshots
        self.min_snapshot_interval_s = min_snapshot_interval_s
        self.stacks_max_age_s = stacks_max_age_s
        self.pyspy_timeout_s = pyspy_timeout_s
        self._mem: deque[Mem] = deque(maxlen=num_mem)
        # snapshot id -> (monotonic time, step, snapshot); oldest first
        self._snapshots: OrderedDict[int, tuple[float, int, HeapSnapshot]] = OrderedDict()
        self._next_id = 0
        self._seq_snapshot: dict[Any, int] = {}
        self._pending: list[Any] = []  # sequences started in the batch being observed
        self._now: tuple[float, HeapSnapshot] | None = None
        self._stacks: tuple[float, dict[str, Any]] | None = None

    # ---- observing -------------------------------------------------------------------------

    def observe(self, event: Event | Unknown) -> None:
        if isinstance(event, SeqStart) and self.heap is not None:
            self._pending.append(event.seq)
        elif isinstance(event, Mem):
            self._mem.append(event)

    def __call__(self, events: list[Event]) -> None:
        """Bus sink: observe a batch, then snapshot for the sequences it started."""
        for event in events:
            self.observe(event)
        self.end_batch(events[-1].step if events else 0)

    def end_batch(self, step: int) -> None:
        """Give the sequences started since the last call a heap snapshot to be compared with."""
        if not self._pending:
            return
        started, self._pending = self._pending, []
        if self.heap is None or not self.heap.tracing:
            return
        snap_id = self._latest_snapshot_id(step)
        for seq in started:
            self._seq_snapshot[seq] = snap_id

    def _latest_snapshot_id(self, step: int) -> int:
        now = time.monotonic()
        if self._snapshots:
            last_id = next(reversed(self._snapshots))
            if now - self._snapshots[last_id][0] < self.min_snapshot_interval_s:
                return last_id
        snapshot = self.heap.snapshot() if self.heap else None
        assert snapshot is not None, "tracemalloc stopped between the check and the snapshot"
        snap_id, self._next_id = self._next_id, self._next_id + 1
        self._snapshots[snap_id] = (now, step, snapshot)
        if len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)
            # sequences that pointed at the dropped snapshot fall back to the oldest kept one
            self._seq_snapshot = {s: i for s, i in self._seq_snapshot.items() if i in self._snapshots}
        return snap_id

    # ---- enriching -------------------------------------------------------------------------

    def enrich(self, finding: Finding) -> Finding:
        """The finding with ``attribution`` filled in (what could not be had says why)."""
        extra: dict[str, Any] = {}
        if self.prober is not None:
            if threading.get_ident() == self.prober.thread_id:
                reading = self.prober.read_now(source=f"finding:{finding.check}/{finding.rule}")
                extra["mem_now"] = reading.to_dict()
            elif self.prober.last is not None:  # a consumer thread must not touch the engine or its bus
                extra["mem_last"] = self.prober.last.to_dict()
        if self._mem:
            extra["mem_recent"] = [to_dict(m) for m in self._mem]
        heap = self._heap_growth(finding.seq)
        if heap is not None:
            extra["heap_growth"] = heap
        if self.pid is not None and not finding.stacks:
            # A stack recorded with the events that caused the finding says where it happened; a dump now
            # only says where the workload's threads are, so it is taken only when nothing was recorded.
            extra.update(self._stacks_now())
        return msgspec.structs.replace(finding, attribution={**finding.attribution, **extra})

    def _heap_growth(self, seq: Any) -> dict[str, Any] | None:
        if self.heap is None or not self.heap.tracing or not self._snapshots:
            return None
        snap_id = self._seq_snapshot.get(seq)
        since = "seq_start"
        if snap_id not in self._snapshots:  # not a sequence's finding, or its snapshot was dropped
            snap_id, since = next(iter(self._snapshots)), "oldest_kept_snapshot"
        taken, step, old = self._snapshots[snap_id]
        sites = top_growth(old, self._current_snapshot(not_before=taken), self.top)
        return {"since": since, "since_step": step, "sites": [s.to_dict() for s in sites]}

    def _current_snapshot(self, not_before: float) -> HeapSnapshot:
        """One snapshot serves every finding of the same moment (findings come in bursts)."""
        now = time.monotonic()
        if self._now is None or self._now[0] <= not_before or now - self._now[0] >= self.min_snapshot_interval_s:
            snapshot = self.heap.snapshot() if self.heap else None
            assert snapshot is not None, "tracemalloc stopped between the check and the snapshot"
            self._now = (now, snapshot)
        return self._now[1]

    def _stacks_now(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._stacks is None or now - self._stacks[0] >= self.stacks_max_age_s:
            assert self.pid is not None
            try:
                threads = dump_stacks(self.pid, timeout_s=self.pyspy_timeout_s)
                threads.sort(key=lambda t: not t.active)  # the threads at work first, idle helpers after
                lines = [line for thread in threads for line in thread.lines()]
                result: dict[str, Any] = {"stacks": lines, "stacks_pid": self.pid}
            except PySpyError as exc:
                result = {"stacks_error": str(exc), "stacks_pid": self.pid}
            self._stacks = (now, result)
        return self._stacks[1]
