"""The memory timeline: RSS, Python heap, GPU and KV bytes per tier, from `mem` and `usage` events."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..render import human_bytes, spark
from ..state import Snapshot

__all__ = ["MemoryView"]

_COLORS = ("green", "cyan", "magenta", "yellow", "red", "dodger_blue1", "bright_blue", "purple", "white")


class MemoryView(Widget):
    DEFAULT_CSS = """
    MemoryView { height: auto; text-wrap: nowrap; text-overflow: clip; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        # The readings change once a step (the snapshot hands the same tuple until then); the height is one line
        # per series, so only a new series needs a layout.
        before, after = (old.memory if old is not None else ()), (new.memory if new is not None else ())
        if before is not after:
            self.refresh(layout=len(before) != len(after))

    def render(self) -> Text:
        s = self.snapshot
        if s is None or not s.memory:
            return Text("no memory readings yet (mem events; `kvdoctor run` and the demo record them)", "dim")
        width = max(self.size.width, 40)
        graph = max(width - 13 - 2 * 11, 8)
        out = Text(no_wrap=True, overflow="crop")
        out.append(f"{'':13}{'over the last steps':<{graph}} {'now':>10} {'peak':>10}\n", "dim")
        for i, (label, values) in enumerate(s.memory):
            color = _COLORS[i % len(_COLORS)]
            out.append(f"{label:<13}", "bold")
            out.append(spark(values, graph), color)
            now = values[-1] if values else None
            peak = max(values) if values else None
            out.append(f" {human_bytes(now):>10} {human_bytes(peak):>10}\n")
        return out
