"""The findings list (newest first, coloured by severity) and the detail pane beside it."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from ...findings import Finding
from ..render import SEVERITY_STYLE
from ..state import Snapshot
from .lines import LineList

__all__ = ["FindingsList", "FindingDetail", "RecentFindings"]

_TAG = {"error": "E", "warning": "W", "info": "I"}
_RECENT = 40  # findings the overview draws: more than its pane can show, newest first


class FindingsList(LineList):
    """Newest first. The cursor stays on the finding it is on while new ones arrive above it."""

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._findings: tuple[Finding, ...] = ()
        self._labels: dict[str, str] = {}

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        new = snapshot.findings if snapshot is not None else ()
        if new is self._findings:
            return
        self._labels = labels_of(snapshot)
        grown = len(new) - len(self._findings)
        self._findings = new
        if self.cursor > 0 and grown > 0:
            self.set_reactive(FindingsList.cursor, self.cursor + grown)
            self.scroll_to(y=self.scroll_offset.y + grown, animate=False)
        self.rows_changed()
        if grown and self.cursor == 0:
            self.post_message(self.Highlighted(self, 0))

    @property
    def selected(self) -> Finding | None:
        return self.finding(self.cursor)

    def finding(self, row: int) -> Finding | None:
        n = len(self._findings)
        return self._findings[n - 1 - row] if 0 <= row < n else None

    def row_count(self) -> int:
        return len(self._findings)

    def row_text(self, row: int, width: int) -> Text:
        f = self.finding(row)
        assert f is not None
        line = _line(f, self._labels)
        line.no_wrap, line.overflow = True, "ellipsis"
        return line


def labels_of(snapshot: Snapshot | None) -> dict[str, str]:
    """Trace name -> its label, in a workload of several traces (none: findings need not name one)."""
    if snapshot is None or len(snapshot.traces) < 2:
        return {}
    return {v.name: v.label for v in snapshot.traces}


def _line(f: Finding, labels: dict[str, str]) -> Text:
    """One finding as the lists show it: severity, step, the trace it came from (in a workload of several),
    check/rule, message."""
    style = SEVERITY_STYLE.get(f.severity, "")
    line = Text()
    line.append(f"{_TAG.get(f.severity, '?')} ", style)
    line.append(f"{'-' if f.step is None else f.step:>5} ", "dim")
    if labels:
        line.append(f"[{labels.get(f.trace, 'workload') if f.trace is not None else 'workload'}] ", "cyan")
    line.append(f"{f.check}/{f.rule} ", style)
    line.append(f.message)
    return line


class RecentFindings(Static):
    """The overview's newest findings, each message in full (wrapped): the pane is half the screen wide, and a
    message cut at its edge hid what the finding says. The findings screen (2) lists them all with details."""

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)  # redrawn by ``update``, on a new finding

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("", **kwargs)
        self._findings: tuple[Finding, ...] = ()

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        new = snapshot.findings if snapshot is not None else ()
        if new is self._findings:
            return
        self._findings = new
        if not new:
            self.update(Text("no findings yet", "dim"))
            return
        labels = labels_of(snapshot)
        text = Text("\n").join(_line(f, labels) for f in reversed(new[-_RECENT:]))
        self.update(text)


class FindingDetail(Static):
    """The selected finding in full: where, why (evidence), the block's story and the Python stack."""

    DEFAULT_CSS = """
    FindingDetail { padding: 0 1; }
    """
