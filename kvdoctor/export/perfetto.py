"""A trace as Chrome trace-event JSON, the format ui.perfetto.dev and chrome://tracing open.

One process per trace ("kvdoctor …") with tracks that say what a person scrolls for: a slice per
engine step, the blocks and KV bytes of each tier as counters, swaps, prefetches and transfers as
slices on a transfer track, every finding of the checks as an instant event carrying its message,
and each sequence as an async slice from admission to its end. Timestamps are the trace's own
``t`` (ns since the trace started) in the format's microseconds, so the timeline is the run's; the
traces of a workload share one timeline, each shifted by its header's wall-clock ``t0``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator

from ..config import Config
from ..events import Prefetch, SeqEnd, SeqStart, StepEnd, SwapIn, SwapOut, TransferStart, Usage
from ..findings import Finding
from ..workload import WorkloadSession

__all__ = ["perfetto_events", "workload_events", "export_perfetto"]

_PID = 1
_TID_STEPS, _TID_TRANSFERS, _TID_FINDINGS = 1, 2, 3
_TRACKS = {_TID_STEPS: "steps", _TID_TRANSFERS: "transfers", _TID_FINDINGS: "findings"}
# A swap or prefetch event marks a finished move without its duration: a short slice keeps it
# visible and clickable without pretending to know how long the copy took.
_TRANSFER_US = 1.0


def _us(t_ns: int) -> float:
    return round(t_ns / 1000.0, 3)  # whole ns: no float noise in the JSON


class _Process:
    """One trace's tracks in the output: a Perfetto process of its own, its events' times shifted by
    ``offset_ns`` so several traces share the workload's wall-clock timeline."""

    def __init__(self, pid: int, name: str, offset_ns: int = 0) -> None:
        self.pid = pid
        self.name = name
        self.offset_ns = offset_ns
        self.step_start: float | None = None
        self.last_us = 0.0
        self.seq_ids: dict[Any, int] = {}

    def metadata(self) -> Iterator[dict]:
        pid = self.pid
        yield {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": self.name}}
        for tid, name in _TRACKS.items():
            yield {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            yield {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}

    def event(self, event: Any) -> Iterator[dict]:
        pid = self.pid
        ts = self.last_us = _us(event.t + self.offset_ns)
        if self.step_start is None:
            self.step_start = ts
        kind = type(event)
        if kind is StepEnd:
            start = round(ts - _us(event.duration_ns), 3) if event.duration_ns else self.step_start
            yield {"ph": "X", "pid": pid, "tid": _TID_STEPS, "name": f"step {event.step}", "cat": "step",
                   "ts": start, "dur": round(max(ts - start, 0.0), 3),
                   "args": {"step": event.step, "num_tokens": event.num_tokens}}
            self.step_start = ts
        elif kind is Usage:
            yield {"ph": "C", "pid": pid, "name": f"{event.tier} blocks", "ts": ts,
                   "args": {"used": event.used_blocks, "capacity": event.capacity_blocks}}
            if event.bytes is not None:
                yield {"ph": "C", "pid": pid, "name": f"{event.tier} KV bytes", "ts": ts, "args": {"bytes": event.bytes}}
        elif kind is SwapOut or kind is SwapIn:
            yield {"ph": "X", "pid": pid, "tid": _TID_TRANSFERS, "cat": "transfer",
                   "name": f"{'swap_out' if kind is SwapOut else 'swap_in'} {event.src}->{event.dst}", "ts": ts,
                   "dur": _TRANSFER_US, "args": {"block": event.block, "version": event.version, "step": event.step}}
        elif kind is Prefetch:
            yield {"ph": "X", "pid": pid, "tid": _TID_TRANSFERS, "cat": "transfer",
                   "name": f"prefetch {event.src}->{event.dst}", "ts": ts, "dur": _TRANSFER_US,
                   "args": {"blocks": len(event.blocks), "step": event.step}}
        elif kind is TransferStart:
            yield {"ph": "X", "pid": pid, "tid": _TID_TRANSFERS, "cat": "transfer",
                   "name": f"{event.op} {event.key or event.transfer}", "ts": ts, "dur": _TRANSFER_US,
                   "args": {"blocks": event.blocks, "seq": event.seq, "src": event.src, "dst": event.dst,
                            "step": event.step}}
        elif kind is SeqStart:
            sid = self.seq_ids.setdefault(event.seq, len(self.seq_ids) + 1)
            yield {"ph": "b", "pid": pid, "cat": "sequence", "id": sid, "name": f"seq {event.seq}",
                   "ts": ts, "args": {"prompt_len": event.prompt_len}}
        elif kind is SeqEnd and event.seq in self.seq_ids:
            yield {"ph": "e", "pid": pid, "cat": "sequence", "id": self.seq_ids.pop(event.seq),
                   "name": f"seq {event.seq}", "ts": ts, "args": {"reason": event.reason}}

    def findings(self, findings: Iterable[Finding]) -> Iterator[dict]:
        for f in findings:
            yield {"ph": "i", "s": "t", "pid": self.pid, "tid": _TID_FINDINGS, "cat": f"finding,{f.severity}",
                   "name": f"{f.check}/{f.rule}", "ts": self.last_us,
                   "args": {"message": f.message, "severity": f.severity, "seq": f.seq, "block": f.block,
                            "layer": f.layer, "step": f.step, "trace": f.trace}}


def perfetto_events(pairs: Iterable[tuple[Any, list[Finding] | tuple]], model: str | None = None) -> Iterator[dict]:
    """Trace events for ``(event, findings it completed)`` pairs of one trace, as ``Session`` iterates them
    (the last pair is ``(None, findings only the end shows)``)."""
    proc = _Process(_PID, f"kvdoctor {model or 'trace'}")
    yield from proc.metadata()
    for event, findings in pairs:
        if event is not None:
            yield from proc.event(event)
        yield from proc.findings(findings)


def workload_events(session: WorkloadSession) -> Iterator[dict]:
    """Trace events for every trace of a workload: a process per trace on one wall-clock timeline (``t0``),
    each finding on the process of the trace it names."""
    procs: dict[int, _Process] = {}
    by_name: dict[str, _Process] = {}
    for tag, event, findings in session.tagged():
        if tag is not None and tag.index not in procs:
            base = session.t0_base or 0
            t0 = tag.header.t0 if tag.header.t0 is not None else base
            proc = procs[tag.index] = by_name[tag.name] = _Process(
                tag.index + 1, f"kvdoctor {tag.who if tag.who != tag.name else tag.header.model or tag.name}",
                offset_ns=t0 - base)
            yield from proc.metadata()
        if event is not None:
            yield from procs[tag.index].event(event)
        for f in findings:
            proc = by_name.get(f.trace) if f.trace is not None else None
            if proc is None:
                proc = procs.get(tag.index) if tag is not None else next(iter(procs.values()), None)
            if proc is None:
                proc = procs[-1] = _Process(len(procs) + 1, "kvdoctor workload")
                yield from proc.metadata()
            yield from proc.findings([f])


def export_perfetto(traces: str | os.PathLike[str] | list[str], out: str | os.PathLike[str],
                    config: Config | None = None) -> int:
    """Write the traces (checked on the way, as ``kvdoctor check`` does: each on its own and across them) to
    ``out`` as Chrome trace-event JSON; returns how many trace events were written."""
    from ..workload import TraceSet

    paths = [os.fspath(traces)] if isinstance(traces, (str, os.PathLike)) else list(traces)
    session = WorkloadSession(TraceSet.open(paths, follow=False), config)
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        for te in workload_events(session):
            f.write((",\n" if n else "") + json.dumps(te, default=str))
            n += 1
        f.write("\n]}\n")
    return n
