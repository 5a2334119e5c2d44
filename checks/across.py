"""What the rules across traces share: who wrote each trace, and how such a rule is fed.

A workload is all of its traces (one per cache, process, rank or instance). The rules that judge one
cache run per trace, in a ``CheckSuite`` each, as for a single trace. The rules here judge what only
several traces show together (ranks agreeing, a transfer's two ends): ``kvdoctor.workload`` merges the
traces' events by wall-clock time and hands each cross-trace check the events of the kinds it ``wants``,
with the ``TraceTag`` of the trace they came from. A check is still a ``CheckBase``, so its rules are
listed, switched off and capped like every other rule (its suite's ledger is unused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Sequence

import msgspec

from ..events import Event, Header
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase

__all__ = ["TraceTag", "AcrossCheck", "readers_of"]


@dataclass(frozen=True)
class TraceTag:
    """One trace of a workload: its place in the workload (``index``), the name reports give it, its header."""

    index: int
    name: str
    header: Header

    @property
    def engine_key(self) -> tuple[Any, ...] | None:
        """The engine this trace is one rank of (instance and data-parallel rank), or None when the header
        says nothing of ranks: such a trace is an engine of its own."""
        h = self.header
        if h.tp_rank is None and h.pp_rank is None:
            return None
        return (h.instance, h.dp_rank)

    @property
    def who(self) -> str:
        """The producer in words: instance and ranks where the header says them, else the trace's name."""
        h = self.header
        parts = [f"instance {h.instance}" if h.instance is not None else None,
                 f"dp {h.dp_rank}" if h.dp_rank is not None else None,
                 f"tp {h.tp_rank}" if h.tp_rank is not None else None,
                 f"pp {h.pp_rank}" if h.pp_rank is not None else None]
        said = [p for p in parts if p]
        return " ".join(said) if said else self.name


class AcrossCheck(CheckBase):
    """Base of the rules across traces: ``trace_added`` when a trace of the workload opens, ``see`` for each
    event of a kind ``wants`` names for that trace, in merged order, ``trace_ended`` when it ends, ``at_end``
    once every trace ended.

    A check that compares each trace with itself step by step (ranks: every rank's decisions of a step, whatever
    the others did meanwhile) needs no merged order: it sets ``merged`` False and gives each trace a ``recorder``,
    which turns the trace's events, a batch at a time in the trace's own order, into compact records (tuples of
    plain values, so the process that checks a finished trace on its own can make and send them); the check
    takes them in with ``see_records`` as the merge reaches each batch, the last with ``ended``. Its events never
    wait in the merge's heap, where most of a workload's events would otherwise pass one by one. Where records
    were made without the details a finding shows, ``reread`` (set by the workload) records the trace again."""

    merged: ClassVar[bool] = True
    # the records of a trace made again in this process with every detail, batch by batch (a check not merged)
    reread: Callable[[TraceTag], Iterable[list]] | None = None

    def wants(self, tag: TraceTag) -> tuple[type[Event], ...]:
        """The event kinds of ``tag``'s trace this check reads (none: the merge skips that trace for it)."""
        return ()

    def trace_added(self, tag: TraceTag) -> Sequence[Finding]:
        return NO_FINDINGS

    def see(self, tag: TraceTag, event: Event) -> Sequence[Finding]:
        return NO_FINDINGS

    def recorder(self, tag: TraceTag, keep: bool = True) -> Any:
        """What of ``tag``'s trace a check that is not ``merged`` keeps: an object with ``record(events)`` and
        ``end()``, each returning a list of records; ``keep`` False leaves out what only a finding's evidence
        needs (``reread`` brings it back). None: nothing of this trace."""
        return None

    def see_records(self, tag: TraceTag, records: Sequence[Any], ended: bool = False) -> Sequence[Finding]:
        """A batch's records of ``tag``'s trace (a check that is not ``merged``); ``ended``: the trace's last."""
        return NO_FINDINGS

    def trace_ended(self, tag: TraceTag) -> Sequence[Finding]:
        return NO_FINDINGS

    def found(self, tag: TraceTag, rule: str, message: str, **fields: Any) -> Finding:
        """A finding of ``rule`` that names the trace it is about."""
        return msgspec.structs.replace(self.finding(rule, message, **fields), trace=tag.name)


def readers_of(checks: Sequence[AcrossCheck], tag: TraceTag) -> tuple[list[tuple[AcrossCheck, frozenset]], list[AcrossCheck]]:
    """The checks that read ``tag``'s trace: the merged ones with the event kinds each reads, and those fed
    records (not ``merged``), each in ``checks``' order. The workload and a worker checking the trace for it
    must split alike: the worker's records are matched to the parent's checks by place."""
    merged: list[tuple[AcrossCheck, frozenset]] = []
    direct: list[AcrossCheck] = []
    for check in checks:
        kinds = check.wants(tag)
        if kinds and check.merged:
            merged.append((check, frozenset(kinds)))
        elif kinds:
            direct.append(check)
    return merged, direct
