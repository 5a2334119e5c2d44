"""Findings: what a check concludes from events, and the protocol every check follows.

A finding names the sequence, block, layer and step it is about, and carries the
evidence that proves it (the events that matter, a block's history), so a user can
fix the bug from the finding alone. Everything here is plain data: findings go to
JSON, SARIF and JUnit reports and across processes unchanged.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any, Iterable, Iterator, Literal, Protocol

import msgspec

from .events import Event, Unknown

__all__ = ["Severity", "SEVERITIES", "Finding", "Check", "severity_rank", "split_frame", "drawn_id"]

# A request id drawn at random or from the clock (vLLM's "0-3fa2b91c", "cmpl-<uuid hex>-0", a uuid4, a time
# stamp): 8 or more hex digits in a row, a decimal digit among them; a counter ("3", "req-12"), a name
# ("gen1.row0") or a word ("deadbeef") is kept as it is
_DRAWN = re.compile(r"(?=[0-9a-f]*[0-9])[0-9a-f]{8,}", re.IGNORECASE)

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
    # The user's code behind the events that caused it, by event kind ("alloc": where the leaked
    # block was allocated, "seq_end": the abort that stranded it), each a list of "file:line function"
    # frames, innermost first, as the producer recorded them; the first is the finding's location.
    stacks: dict[str, list[str]] = msgspec.field(default_factory=dict)
    # Attribution added by probes: Python stacks, tracemalloc top sites, memory around the finding.
    attribution: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def code_location(self) -> tuple[str, int] | None:
        """The user's ``(file, line)`` the finding traces back to: its first stack's innermost frame."""
        for frames in self.stacks.values():
            if frames:
                return split_frame(frames[0])[:2]
        return None

    @property
    def key(self) -> str:
        """Identity for baselines and code scanning: the rule, what it is about and where in the user's
        code, stable across runs of the same workload: never a step, a timing or a measured value."""
        seq = self.seq
        if drawn_id(seq) and "seq_index" in self.evidence:
            seq = f"#{self.evidence['seq_index']}"  # a server's random request id: its place in the trace instead
        parts = [f"{self.check}/{self.rule}/seq={seq}/block={self.block}/layer={self.layer}"]
        tier = self.evidence.get("tier")
        if tier is not None:
            parts.append(f"tier={tier}")
        where = self.code_location
        if where is not None:
            parts.append(f"at={where[0]}:{where[1]}")
        if self.trace is not None:
            parts.append(f"trace={PurePath(self.trace).name}")
        return "/".join(parts)


def drawn_id(seq: Any) -> bool:
    """Whether ``seq`` is an id a server drew at random, which a fingerprint must not carry."""
    return isinstance(seq, str) and _DRAWN.search(seq) is not None


def split_frame(frame: str) -> tuple[str, int, str]:
    """``"app.py:12 main"`` -> ``("app.py", 12, "main")``; a frame without a line number keeps line 0."""
    where, _, function = frame.rpartition(" ") if " " in frame else (frame, "", "")
    path, _, line = where.rpartition(":")
    if not path or not line.isdigit():
        return where, 0, function
    return path, int(line), function


class Check(Protocol):
    """A pure consumer of events. The same object runs live, over a trace and in pytest."""

    name: str

    def observe(self, event: Event | Unknown) -> Iterable[Finding]:
        """Take one event; return the findings it completes (usually none)."""
        ...

    def finish(self) -> Iterator[Finding] | list[Finding]:
        """The trace ended: return what can only be concluded at the end."""
        ...
