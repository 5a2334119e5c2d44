"""Findings: what a check concludes from events, and the protocol every check follows.

A finding names the sequence, block, layer and step it is about, and carries the
evidence that proves it (the events that matter, a block's history), so a user can
fix the bug from the finding alone. Everything here is plain data: findings go to
JSON, SARIF and JUnit reports and across processes unchanged.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Literal, Protocol

import msgspec

from .events import Event, Unknown

__all__ = ["Severity", "SEVERITIES", "Finding", "Check", "severity_rank"]

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")  # most severe first


def severity_rank(severity: str) -> int:
    """Larger is more severe, so ``rank(f.severity) >= rank(fail_on)`` selects what fails a run."""
    return len(SEVERITIES) - SEVERITIES.index(severity)


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    check: str
    rule: str
    severity: Severity
    message: str
    seq: int | str | None = None
    block: int | None = None
    layer: int | None = None
    step: int | None = None
    # The trace the finding came from, where a workload wrote several (one per engine, process or
    # rank): set by the reader that merges them, so a report says which file to open.
    trace: str | None = None
    # What proves it: encoded events (as dicts), a block's history, counts; free-form per rule.
    evidence: dict[str, Any] = msgspec.field(default_factory=dict)
    # Attribution added by probes: Python stacks, tracemalloc top sites, memory around the finding.
    attribution: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identity for baselines: stable across runs of the same workload, free of timings."""
        return f"{self.check}/{self.rule}/seq={self.seq}/block={self.block}/layer={self.layer}"


class Check(Protocol):
    """A pure consumer of events. The same object runs live, over a trace and in pytest."""

    name: str

    def observe(self, event: Event | Unknown) -> Iterable[Finding]:
        """Take one event; return the findings it completes (usually none)."""
        ...

    def finish(self) -> Iterator[Finding] | list[Finding]:
        """The trace ended: return what can only be concluded at the end."""
        ...
