"""What every check shares: its rule table, its handlers by event type, and how it runs.

A check is a set of rules over the shared ``Ledger``. It says which event types it wants
(``handlers``), judges each one against the state the earlier events built, and may
conclude more at the end of a step (``end_step``) or of the trace (``at_end``). The
``CheckSuite`` feeds one event to the handlers that want it and then to the ledger, so a
check never pays for events it ignores. Used alone, a check builds a suite of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Sequence

import msgspec

from ..events import Event, ObserverError, StepEnd, Unknown, to_dict
from ..findings import Finding, Severity, drawn_id

from .causes import Causes
from .ledger import Ledger

__all__ = ["Rule", "CheckBase", "CheckSuite", "NO_FINDINGS"]

NO_FINDINGS: tuple = ()  # what a handler returns almost always: no allocation per event

Handler = Callable[[Any], Sequence[Finding]]


@dataclass(frozen=True)
class Rule:
    """A stable rule id within its check, its default severity and what it means."""

    id: str
    severity: Severity
    summary: str


class CheckBase:
    """Base of the built-in checks. Subclasses set ``name``, ``RULES`` and ``handlers``."""

    name: ClassVar[str]
    RULES: ClassVar[tuple[Rule, ...]]

    def __init__(self, ledger: Ledger | None = None) -> None:
        self._owns_ledger = ledger is None
        self._solo: CheckSuite | None = None
        self.ledger = ledger if ledger is not None else Ledger()
        self._severity = {r.id: r.severity for r in self.RULES}
        # Set by the suite: rules switched off, and rules over their cap (counted, not built).
        self._disabled: set[str] = set()
        self._capped: set[str] = set()
        self.num_capped = 0
        self._reported: set = set()  # (rule, *key) already reported: one finding each

    # ---- what subclasses provide -----------------------------------------------------

    def handlers(self) -> dict[type, Handler]:
        """Event type -> bound method returning the findings that event completes."""
        return {}

    def end_step(self, step: int) -> Sequence[Finding]:
        return NO_FINDINGS

    def at_end(self) -> Sequence[Finding]:
        """Rules that only the end of the trace can settle."""
        return NO_FINDINGS

    # ---- the Check protocol, when used on its own ------------------------------------

    def observe(self, event: Event | Unknown) -> Sequence[Finding]:
        return self._alone().observe(event)

    def finish(self) -> list[Finding]:
        """The trace ended (used alone): the open step's rules, then ``at_end``."""
        return self._alone().finish()

    def _alone(self) -> CheckSuite:
        if not self._owns_ledger:
            raise RuntimeError(f"check {self.name!r} shares a ledger: feed its CheckSuite instead")
        if self._solo is None:
            self._solo = CheckSuite([self], ledger=self.ledger)
        return self._solo

    # ---- helpers for rules -----------------------------------------------------------

    def once(self, rule: str, *key: Any) -> bool:
        """True the first time (rule, key) comes up while the rule is live: report it then."""
        k = (rule, *key)
        if k in self._reported or self.muted(rule):
            return False
        self._reported.add(k)
        return True

    def muted(self, rule: str) -> bool:
        """True when a finding of ``rule`` would be dropped: skip building its evidence."""
        if rule in self._disabled:
            return True
        if rule in self._capped:
            self.num_capped += 1
            return True
        return False

    def finding(
        self, rule: str, message: str, *, seq: Any = None, block: int | None = None,
        layer: int | None = None, step: int | None = None, **evidence: Any,
    ) -> Finding:
        return Finding(
            check=self.name, rule=rule, severity=self._severity[rule], message=message,
            seq=seq, block=block, layer=layer, step=step, evidence=evidence,
        )

    @staticmethod
    def event_dict(event: Event) -> dict[str, Any]:
        return to_dict(event)


class CheckSuite:
    """Runs checks over one stream of events with one shared ledger.

    Also where policy applies: disabled rules are dropped, a finding of a cause already reported
    is counted in that finding's cascade (``causes``), severities overridden, and each rule
    reports at most ``max_per_rule`` findings (the rest are counted in ``suppressed``), so a
    systematic bug cannot flood a report or memory.
    """

    def __init__(
        self, checks: Iterable[CheckBase], *, ledger: Ledger | None = None,
        disabled: Iterable[str] = (), severity: dict[str, Severity] | None = None,
        max_per_rule: int = 100,
    ) -> None:
        self.checks = list(checks)
        self.ledger = ledger if ledger is not None else self.checks[0].ledger
        for check in self.checks:
            assert check.ledger is self.ledger, f"check {check.name} has another ledger"
        self.disabled = frozenset(disabled)
        for check in self.checks:
            check._disabled = {r.id for r in check.RULES if check.name in self.disabled
                               or f"{check.name}/{r.id}" in self.disabled}
        self.severity = dict(severity or {})
        self.max_per_rule = max_per_rule
        self.findings: list[Finding] = []
        self.causes = Causes(self.ledger)
        self.counts: dict[str, int] = {}  # "check/rule" -> findings raised, kept or not (cascades apart)
        self.num_events = 0
        self._step = 0
        self._step_closed = False
        self._finished = False
        self.lost = False  # a producer stopped tracing (observer_error): nothing after it is judged
        dispatch: dict[type, list[Handler]] = {}
        for check in self.checks:
            for cls, handler in check.handlers().items():
                dispatch.setdefault(cls, []).append(handler)
        # One lookup per event: the checks' handlers, then the ledger's update (which returns
        # None, so the loop treats it like a handler that found nothing).
        for cls, apply in self.ledger.appliers().items():
            dispatch.setdefault(cls, []).append(apply)
        dispatch.setdefault(StepEnd, []).append(self._step_end)
        dispatch.setdefault(ObserverError, []).append(self._observer_error)
        self._route: dict[type, tuple[Handler, ...]] = {cls: tuple(hs) for cls, hs in dispatch.items()}
        self._by_name = {c.name: c for c in self.checks}

    @property
    def suppressed(self) -> int:
        """Findings over their rule's cap: counted, not kept."""
        return sum(self.counts.values()) - len(self.findings) + sum(c.num_capped for c in self.checks)

    def observe(self, event: Event | Unknown) -> Sequence[Finding]:
        """Judge one event; returns the findings it completed (an empty tuple mostly)."""
        out: Sequence[Finding] = NO_FINDINGS
        if event.step != self._step:
            out = self._new_step(event.step)
        handlers = self._route.get(type(event))
        if handlers is not None:
            for handler in handlers:
                found = handler(event)
                if found:
                    out = self._accept(found, out)
        self.num_events += 1
        return out

    def observe_many(self, events: Iterable[Event | Unknown]) -> list[Finding]:
        """Judge a batch (a Bus sink, or a trace's chunk); returns everything it completed.

        The same as ``observe`` per event, written out once more because this loop is the
        replay and live hot path: no call per event beyond the handlers themselves.
        """
        out: list[Finding] = []
        route = self._route.get
        index = self.num_events - 1  # stays so when the batch is empty
        step = self._step
        for index, event in enumerate(events, index + 1):
            if event.step != step:
                self.num_events = index
                out.extend(self._new_step(event.step))
                step = self._step
            handlers = route(type(event))
            if handlers is not None:
                for handler in handlers:
                    found = handler(event)
                    if found:
                        self.num_events = index
                        out.extend(self._accept(found, NO_FINDINGS))
        self.num_events = index + 1
        return out

    def add(self, findings: Iterable[Finding]) -> list[Finding]:
        """Findings from outside the checks (a workload's exit status), under the same policy."""
        return self._accept(findings, NO_FINDINGS)

    def finish(self) -> list[Finding]:
        """The trace ended: each check's end-of-trace rules, then close the open step."""
        if self._finished:
            return []
        self._finished = True
        if self.lost:
            return []
        # End-of-trace rules first: a step the trace cut short never ended, so what is still
        # pending in it is "left at the end", not "not freed by the end of its step".
        out: Sequence[Finding] = NO_FINDINGS
        for check in self.checks:
            found = check.at_end()
            if found:
                out = self._accept(found, out)
        return list(self._close_step(out))

    # ---- internals --------------------------------------------------------------------

    def _observer_error(self, event: ObserverError) -> Sequence[Finding]:
        """After the checks' own handlers: a producer that stopped tracing leaves the trace incomplete, so
        from here the suite judges nothing (no end-of-step or end-of-trace rule) but further such errors."""
        if event.stopped and not self.lost:
            self.lost = True
            self._step_closed = True
            keep = self._route[ObserverError]
            self._route.clear()  # in place: observe_many's loop holds this dict's lookup
            self._route[ObserverError] = keep
        return NO_FINDINGS

    def _new_step(self, step: int) -> Sequence[Finding]:
        if step < self._step:
            return NO_FINDINGS  # a producer bug; never re-close an old step
        if self.lost:
            self._step = self.ledger.step = step
            return NO_FINDINGS
        out = self._close_step(NO_FINDINGS)
        self._step = self.ledger.step = step
        self._step_closed = False
        return out

    def _step_end(self, event: StepEnd | None) -> list[Finding]:
        """The last handler of a ``step_end``: the step's end-of-step rules (not yet accepted)."""
        if self._step_closed:
            return []
        self._step_closed = True
        found: list[Finding] = []
        for check in self.checks:
            found.extend(check.end_step(self._step))
        return found

    def _close_step(self, out: Sequence[Finding]) -> Sequence[Finding]:
        found = self._step_end(None)
        return self._accept(found, out) if found else out

    def _accept(self, found: Iterable[Finding], out: Sequence[Finding]) -> list[Finding]:
        kept = list(out)
        for f in found:
            key = f"{f.check}/{f.rule}"
            if key in self.disabled or f.check in self.disabled:
                continue
            if self.causes.absorb(f):  # a cascade of a cause already reported: counted there, not capped
                continue
            count = self.counts.get(key, 0) + 1
            self.counts[key] = count
            if count >= self.max_per_rule:
                self._by_name[f.check]._capped.add(f.rule)
                if count > self.max_per_rule:
                    continue
            severity = self.severity.get(key)
            if severity is not None and severity != f.severity:
                f = _with_severity(f, severity)
            if not f.stacks:
                stacks = self.ledger.stacks(f.block, f.seq)
                if stacks:
                    f = msgspec.structs.replace(f, stacks=stacks)
            f.evidence.setdefault("event_index", self.num_events)
            if drawn_id(f.seq) and f.seq in self.ledger.seq_index:  # what its fingerprint names instead
                f.evidence.setdefault("seq_index", self.ledger.seq_index[f.seq])
            kept.append(f)
            self.findings.append(f)
        return kept


def _with_severity(f: Finding, severity: Severity) -> Finding:
    return msgspec.structs.replace(f, severity=severity)
