"""The trace selector: a workload's traces on one line, the one on screen highlighted (t / T switch).

Only a workload of several traces shows it; with one trace it takes no room, so the single-trace screens
look as they always did.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..state import Snapshot

__all__ = ["TraceBar"]


class TraceBar(Widget):
    DEFAULT_CSS = """
    TraceBar { height: 1; padding: 0 1; display: none; text-wrap: nowrap; text-overflow: ellipsis; }
    TraceBar.several { display: block; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        self.set_class(new is not None and len(new.traces) > 1, "several")
        if old is None or new is None or (old.traces, old.shown) != (new.traces, new.shown):
            self.refresh()  # not every frame: the traces and the one shown seldom change

    def render(self) -> Text:
        s = self.snapshot
        line = Text()
        if s is None or len(s.traces) < 2:
            return line
        line.append(f"trace {s.shown + 1}/{len(s.traces)} ", "bold")
        for i, view in enumerate(s.traces):
            line.append(" ")
            line.append(f" {i + 1} {view.label} ", "bold reverse" if i == s.shown else "dim")
        line.append("  t/T: next/previous", "dim")
        return line
