"""Leaks: blocks nobody can reach any more, and tiers whose counts disagree with the events.

A leak here means *unreachable*, not "memory in use": a block whose last owner released it
(or ended) and that was not freed or evicted by the end of that step. Nothing can read it
or free it later, so its slot is lost for the life of the process — and the block most
often lost is one swapped out to host or disk when its sequence ended, because the code
that frees a sequence's blocks usually walks the device tier only. Blocks held on purpose
(a prefix cache, a live sequence, a fork sharing a parent's prefix) always have an owner,
so they are never reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..events import Usage
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule
from .ledger import Ledger

__all__ = ["LeakCheck", "LeakSettings"]

_SLOW_TIERS = ("host", "disk")


@dataclass(frozen=True)
class LeakSettings:
    """``grace_steps``: how many further steps an ownerless block may wait for its ``free``
    (0 = the contract: within the same step; raise it for an engine that frees lazily)."""

    grace_steps: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.grace_steps <= 1_000_000:
            raise ValueError(f"leak.grace_steps must be in [0, 1000000], got {self.grace_steps}")


class LeakCheck(CheckBase):
    name = "leak"
    RULES = (
        Rule("unreachable-swapped", "error",
             "a block on host or disk lost its last owner and was not freed or evicted by the end of its step"),
        Rule("unreachable", "error",
             "a device block lost its last owner and was not freed or evicted by the end of its step"),
        Rule("usage-mismatch", "error",
             "a tier's usage event disagrees with the blocks the events leave allocated there"),
        Rule("left-at-end", "error",
             "the trace ends with blocks of ended sequences still allocated"),
    )

    def __init__(self, settings: LeakSettings | None = None, ledger: Ledger | None = None) -> None:
        super().__init__(ledger)
        self.settings = settings or LeakSettings()
        self._usage_delta: dict[str, int] = {}  # tier -> largest difference reported

    def handlers(self):
        return {Usage: self._usage}

    def end_step(self, step: int) -> Sequence[Finding]:
        orphans = self.ledger.orphans
        if not orphans:
            return NO_FINDINGS
        deadline = step - self.settings.grace_steps
        overdue = [b for b, s in orphans.items() if s <= deadline]
        out = []
        for block in overdue:
            out.append(self._unreachable(block, orphans[block], step, at_end=False))
            self.ledger.strand(block)
        return out

    def at_end(self) -> Sequence[Finding]:
        # The trace stopped mid-step or within the grace: what is still ownerless stays so.
        ledger = self.ledger
        out = []
        for block, since in list(ledger.orphans.items()):
            out.append(self._unreachable(block, since, ledger.step, at_end=True))
            ledger.strand(block)
        return out

    def _unreachable(self, block: int, since: int, step: int, *, at_end: bool) -> Finding:
        ledger = self.ledger
        tier = ledger.tier[block]
        history = ledger.block_history(block)
        last_owner = _last_owner(history)
        where = f"on {tier}" if tier in _SLOW_TIERS else "on device"
        if at_end:
            rule = "left-at-end"
            message = (f"block {block} ({where}) of ended sequence {last_owner!r} is still allocated "
                       f"when the trace ends; it lost its last owner at step {since}")
        else:
            rule = "unreachable-swapped" if tier in _SLOW_TIERS else "unreachable"
            if block in ledger.ownerless_at_attach:
                message = (f"block {block} sits {where} with no owner: it had none already when kvdoctor attached at "
                           f"step {since} (its last owner, sequence {last_owner!r}, had ended) and nothing freed or "
                           f"evicted it by the end of step {step}")
            else:
                message = (f"block {block} sits {where} with no owner: sequence {last_owner!r} let go of it "
                           f"at step {since} and nothing freed or evicted it by the end of step {step}")
        return self.finding(
            rule, message, seq=last_owner, block=block, step=since,
            tier=tier, orphaned_at_step=since, judged_at_step=step, history=history,
        )

    def _usage(self, ev: Usage) -> Sequence[Finding]:
        counted = self.ledger.used.get(ev.tier, 0)
        delta = ev.used_blocks - counted
        if delta == 0:
            return NO_FINDINGS
        # Report a tier again only when the disagreement grows (or flips sign): a drift that
        # comes and goes every step is one finding, not one per step.
        worst = self._usage_delta.get(ev.tier, 0)
        if (delta > 0) == (worst > 0) and abs(delta) <= abs(worst):
            return NO_FINDINGS
        self._usage_delta[ev.tier] = delta
        stranded = sorted(b for b in self.ledger.stranded if self.ledger.tier.get(b) == ev.tier)
        return [self.finding(
            "usage-mismatch",
            f"tier {ev.tier} reports {ev.used_blocks} blocks in use but the events leave {counted} "
            f"allocated there ({delta:+d})",
            step=ev.step, tier=ev.tier, reported=ev.used_blocks, counted=counted,
            capacity=ev.capacity_blocks, stranded_blocks=stranded[:32], events=[self.event_dict(ev)],
        )]


def _last_owner(history: list[dict]):
    """The sequence that let go last: the newest release/seq_end/alloc/share in the history."""
    for event in reversed(history):
        if event.get("kind") in ("release", "seq_end", "share", "alloc"):
            return event.get("seq")
    return None
