"""Observer: the doctor itself lost track of the engine it watches.

A producer inside vLLM or transformers never lets its own failure reach its host: it records an
``observer_error``, stops tracing and lets the host go on. That must still fail a CI gate, or a run
the doctor stopped watching at step 3 would pass as clean. The suite judges nothing after a stopping
``observer_error`` (the trace is incomplete from there, and what it misses would read as leaks), so
this finding is the run's verdict: kvdoctor, not the engine, needs fixing or updating.
"""

from __future__ import annotations

from typing import Sequence

from ..events import ObserverError
from ..findings import Finding

from .base import CheckBase, Rule

__all__ = ["ObserverCheck"]


class ObserverCheck(CheckBase):
    name = "observer"
    RULES = (
        Rule("lost-track", "error",
             "kvdoctor's own producer failed inside the engine it watches and stopped tracing; the engine went on"),
    )

    def handlers(self):
        return {ObserverError: self._lost}

    def _lost(self, ev: ObserverError) -> Sequence[Finding]:
        where = f" at {ev.where}" if ev.where else ""
        after = "stopped tracing there" if ev.stopped else "went on tracing"
        return [self.finding(
            "lost-track",
            f"kvdoctor lost track of {ev.producer} in {ev.part} at step {ev.step} ({ev.error}: {ev.message}{where}); "
            f"it {after} and {ev.producer} went on: nothing after step {ev.step} was judged. "
            f"Report this to kvdoctor with the {ev.producer} version",
            step=ev.step, producer=ev.producer, part=ev.part, error=ev.error, where=ev.where,
        )]
