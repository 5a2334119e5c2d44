"""A trace as Chrome trace-event JSON, the format ui.perfetto.dev and chrome://tracing open.

One process ("kvdoctor") with tracks that say what a person scrolls for: a slice per engine
step, the blocks and KV bytes of each tier as counters, swaps and prefetches as slices on a
transfer track, every finding of the checks as an instant event carrying its message, and
each sequence as an async slice from admission to its end. Timestamps are the trace's own
``t`` (ns since the trace started) in the format's microseconds, so the timeline is the run's.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator

from ..config import Config
from ..events import Prefetch, SeqEnd, SeqStart, StepEnd, SwapIn, SwapOut, Usage
from ..findings import Finding

__all__ = ["perfetto_events", "export_perfetto"]

_PID = 1
_TID_STEPS, _TID_TRANSFERS, _TID_FINDINGS = 1, 2, 3
_TRACKS = {_TID_STEPS: "steps", _TID_TRANSFERS: "transfers", _TID_FINDINGS: "findings"}
# A swap or prefetch event marks a finished move without its duration: a short slice keeps it
# visible and clickable without pretending to know how long the copy took.
_TRANSFER_US = 1.0


def _us(t_ns: int) -> float:
    return round(t_ns / 1000.0, 3)  # whole ns: no float noise in the JSON


def perfetto_events(pairs: Iterable[tuple[Any, list[Finding] | tuple]], model: str | None = None) -> Iterator[dict]:
    """Trace events for ``(event, findings it completed)`` pairs, as ``Session`` iterates them
    (the last pair is ``(None, findings only the end shows)``)."""
    yield {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": f"kvdoctor {model or 'trace'}"}}
    for tid, name in _TRACKS.items():
        yield {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": name}}
        yield {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}
    step_start: float | None = None
    last_us = 0.0
    seq_ids: dict[Any, int] = {}
    for event, findings in pairs:
        if event is not None:
            ts = last_us = _us(event.t)
            if step_start is None:
                step_start = ts
            kind = type(event)
            if kind is StepEnd:
                start = round(ts - _us(event.duration_ns), 3) if event.duration_ns else step_start
                yield {"ph": "X", "pid": _PID, "tid": _TID_STEPS, "name": f"step {event.step}", "cat": "step",
                       "ts": start, "dur": round(max(ts - start, 0.0), 3),
                       "args": {"step": event.step, "num_tokens": event.num_tokens}}
                step_start = ts
            elif kind is Usage:
                yield {"ph": "C", "pid": _PID, "name": f"{event.tier} blocks", "ts": ts,
                       "args": {"used": event.used_blocks, "capacity": event.capacity_blocks}}
                if event.bytes is not None:
                    yield {"ph": "C", "pid": _PID, "name": f"{event.tier} KV bytes", "ts": ts,
                           "args": {"bytes": event.bytes}}
            elif kind is SwapOut or kind is SwapIn:
                yield {"ph": "X", "pid": _PID, "tid": _TID_TRANSFERS, "cat": "transfer",
                       "name": f"{'swap_out' if kind is SwapOut else 'swap_in'} {event.src}->{event.dst}", "ts": ts, "dur": _TRANSFER_US,
                       "args": {"block": event.block, "version": event.version, "step": event.step}}
            elif kind is Prefetch:
                yield {"ph": "X", "pid": _PID, "tid": _TID_TRANSFERS, "cat": "transfer",
                       "name": f"prefetch {event.src}->{event.dst}", "ts": ts, "dur": _TRANSFER_US,
                       "args": {"blocks": len(event.blocks), "step": event.step}}
            elif kind is SeqStart:
                sid = seq_ids.setdefault(event.seq, len(seq_ids) + 1)
                yield {"ph": "b", "pid": _PID, "cat": "sequence", "id": sid, "name": f"seq {event.seq}",
                       "ts": ts, "args": {"prompt_len": event.prompt_len}}
            elif kind is SeqEnd and event.seq in seq_ids:
                yield {"ph": "e", "pid": _PID, "cat": "sequence", "id": seq_ids.pop(event.seq),
                       "name": f"seq {event.seq}", "ts": ts, "args": {"reason": event.reason}}
        for f in findings:
            yield {"ph": "i", "s": "t", "pid": _PID, "tid": _TID_FINDINGS, "cat": f"finding,{f.severity}",
                   "name": f"{f.check}/{f.rule}", "ts": last_us,
                   "args": {"message": f.message, "severity": f.severity, "seq": f.seq, "block": f.block,
                            "layer": f.layer, "step": f.step}}


def export_perfetto(trace: str | os.PathLike[str], out: str | os.PathLike[str], config: Config | None = None) -> int:
    """Write ``trace`` (checked on the way, as ``kvdoctor check`` does) to ``out`` as Chrome
    trace-event JSON; returns how many trace events were written."""
    from ..session import Session, TraceSource

    source = TraceSource(trace)
    session = Session(source, config)
    model = source.wait_header().model
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        for te in perfetto_events(session, model):
            f.write((",\n" if n else "") + json.dumps(te, default=str))
            n += 1
        f.write("\n]}\n")
    return n
