"""kvdoctor's checks: pure consumers of v1 events that turn them into findings.

Each check is a small class holding only the state it needs; all of them share one
``Ledger`` (the cache as the events describe it) inside a ``CheckSuite``. The same code
runs live on an engine's bus, over a trace file and inside pytest. This package imports
``kvdoctor.events`` and ``kvdoctor.findings`` only — no torch.

    suite = make_suite()
    for event in events:
        for finding in suite.observe(event): ...
    findings = suite.findings + suite.finish()   # suite.findings holds everything kept
"""

from __future__ import annotations

from typing import Iterable

from ..findings import Severity

from .accounting import AccountingCheck
from .adapters import AdaptersCheck
from .across import AcrossCheck, TraceTag, readers_of
from .attention import AttentionCheck, AttentionSettings
from .attention_profile import AttentionProfile, ProfileBuilder, shipped_profile
from .base import CheckBase, CheckSuite, Rule
from .batch import BatchCheck
from .codec import CodecCheck
from .handoff import HandoffCheck
from .integrity import IntegrityCheck
from .leak import LeakCheck, LeakSettings
from .ledger import ENDED_KEPT, FREED_KEPT, Ledger
from .observer import ObserverCheck
from .prefix import PrefixCheck
from .ranks import RanksCheck
from .slots import SlotsCheck
from .stale import StaleCheck
from .transfer import TransferCheck
from .weights import WeightsCheck

__all__ = [
    "ALL_CHECKS", "RULES", "make_suite", "CheckBase", "CheckSuite", "Rule", "Ledger",
    "LeakCheck", "LeakSettings", "StaleCheck", "BatchCheck", "AttentionCheck", "AttentionSettings",
    "AttentionProfile", "ProfileBuilder", "shipped_profile",
    "AccountingCheck", "CodecCheck", "IntegrityCheck", "PrefixCheck", "ObserverCheck",
    "WeightsCheck", "TransferCheck", "AdaptersCheck", "SlotsCheck", "ACROSS_CHECKS", "make_across_suite",
    "AcrossCheck", "TraceTag", "readers_of", "RanksCheck", "HandoffCheck",
]

ALL_CHECKS: tuple[type[CheckBase], ...] = (
    LeakCheck, StaleCheck, BatchCheck, AttentionCheck, AccountingCheck, CodecCheck, IntegrityCheck, PrefixCheck,
    ObserverCheck, WeightsCheck, TransferCheck, AdaptersCheck, SlotsCheck, RanksCheck, HandoffCheck,
)
# The checks that judge several traces of one workload together (``kvdoctor.workload`` feeds them).
ACROSS_CHECKS: tuple[type[AcrossCheck], ...] = (RanksCheck, HandoffCheck)

# "check/rule" -> Rule, for configuration, reports (SARIF rule tables) and docs.
RULES: dict[str, Rule] = {f"{c.name}/{r.id}": r for c in ALL_CHECKS for r in c.RULES}


def make_suite(
    *, leak: LeakSettings | None = None, attention: AttentionSettings | None = None,
    disabled: Iterable[str] = (), severity: dict[str, Severity] | None = None,
    max_per_rule: int = 100, history: int = 12, attention_profile: AttentionProfile | None = None,
    freed_kept: int = FREED_KEPT, ended_kept: int = ENDED_KEPT,
) -> CheckSuite:
    """Every built-in check over one shared ledger. ``disabled`` holds check names or
    ``check/rule`` ids; ``severity`` overrides a rule's default severity by id;
    ``attention_profile`` is the model's normal attention (None: learned from the trace);
    ``freed_kept``/``ended_kept`` bound what the ledger remembers of freed blocks and ended
    sequences, so a run of any length holds its memory flat."""
    ledger = Ledger(history=history, freed_kept=freed_kept, ended_kept=ended_kept)
    checks = [
        LeakCheck(leak, ledger), StaleCheck(ledger), BatchCheck(ledger),
        AttentionCheck(attention, ledger, attention_profile), AccountingCheck(ledger), CodecCheck(ledger),
        IntegrityCheck(ledger), PrefixCheck(ledger), ObserverCheck(ledger),
        WeightsCheck(ledger), TransferCheck(ledger), AdaptersCheck(ledger), SlotsCheck(ledger),
    ]
    disabled = set(disabled)
    return CheckSuite([c for c in checks if c.name not in disabled], ledger=ledger,
                      disabled=disabled, severity=severity, max_per_rule=max_per_rule)


def make_across_suite(
    *, disabled: Iterable[str] = (), severity: dict[str, Severity] | None = None, max_per_rule: int = 100,
) -> CheckSuite:
    """The rules across a workload's traces, under the same policy as ``make_suite`` (their ledger is unused)."""
    ledger = Ledger()
    disabled = set(disabled)
    return CheckSuite([c(ledger) for c in ACROSS_CHECKS if c.name not in disabled], ledger=ledger,
                      disabled=disabled, severity=severity, max_per_rule=max_per_rule)
