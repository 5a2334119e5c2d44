"""The workload's own output: what a workload kvdoctor started prints (the demo prints each answer)."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from ..state import Snapshot

__all__ = ["OutputView"]

_NONE = ("the output of a workload kvdoctor starts (watch --demo, watch -- CMD) shows here; "
         "a trace written by another process has none")


class OutputView(Static):
    """The end of the workload's log, newest last, kept scrolled to its end as it grows."""

    DEFAULT_CSS = """
    OutputView { padding: 0 1; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)  # redrawn by ``update``, on new output

    def __init__(self) -> None:
        super().__init__(Text(_NONE, "dim"))
        self._shown = ""

    def watch_snapshot(self, snapshot: Snapshot | None) -> None:
        output = snapshot.output if snapshot is not None else ""
        if output == self._shown:
            return
        self._shown = output
        self.update(Text(output.rstrip("\n")) if output else Text(_NONE, "dim"))
        if self.parent is not None:
            self.parent.scroll_end(animate=False)
