"""Tier gauges: for device, host and disk, how many blocks are owned, shared, leaked and free,
with a sparkline of occupancy over the last steps."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..render import human_bytes, spark
from ..state import Snapshot, TierView

__all__ = ["TierGauges", "TIER_STYLE"]

TIER_STYLE = {"device": "green", "host": "dodger_blue1", "disk": "magenta"}
_LEGEND = (("live", "█"), ("shared", "▒"), ("leaked", "!"), ("free", "·"))


class TierGauges(Widget):
    DEFAULT_CSS = """
    TierGauges { height: auto; text-wrap: nowrap; text-overflow: clip; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        # Drawn again only when a tier changed, and laid out again (its height is its lines) only when the number
        # of tiers did: a layout of the whole screen every frame was most of a frame's cost.
        before, after = (old.tiers if old is not None else ()), (new.tiers if new is not None else ())
        if before != after:
            self.refresh(layout=len(before) != len(after))

    def render(self) -> Text:
        s = self.snapshot
        if s is None or not s.tiers:
            return Text("no tiers yet", "dim")
        width = max(self.size.width, 40)
        out = Text(no_wrap=True, overflow="crop")
        for i, tier in enumerate(s.tiers):
            if i:
                out.append("\n")
            out.append_text(_gauge_line(tier, width))
            out.append("\n")
            out.append_text(_detail_line(tier, width))
        return out


def _gauge_line(tier: TierView, width: int) -> Text:
    color = TIER_STYLE.get(tier.name, "white")
    counts = f" {tier.used:>6}/{tier.capacity:<6}"
    bar_width = max(width - 7 - len(counts) - 2, 8)
    cap = max(tier.capacity, tier.used, 1)
    cells = [round(n * bar_width / cap) for n in (tier.owned, tier.shared, tier.leaked)]
    # A leak of one block must still show: round anything non-zero up to one cell.
    cells = [max(c, 1) if n else c for c, n in zip(cells, (tier.owned, tier.shared, tier.leaked))]
    # Blocks the engine counts but the events do not explain (or the reverse) show as unattributed.
    other = max(min(round(tier.used * bar_width / cap), bar_width) - sum(cells), 0)
    free = max(bar_width - sum(cells) - other, 0)
    line = Text()
    line.append(f"{tier.name:<7}", f"bold {color}")
    line.append("▕", "dim")
    line.append("█" * cells[0], color)
    line.append("▒" * cells[1], f"bold {color}")
    line.append("!" * cells[2], "bold white on red")
    line.append("▓" * other, f"dim {color}")
    line.append("·" * free, "dim")
    line.append("▏", "dim")
    line.append(counts)
    return line


def _detail_line(tier: TierView, width: int) -> Text:
    color = TIER_STYLE.get(tier.name, "white")
    line = Text(" " * 7)
    for (label, _), n, style in zip(
        _LEGEND, (tier.owned, tier.shared, tier.leaked, tier.free),
        (color, f"bold {color}", "bold red" if tier.leaked else "dim", "dim"),
    ):
        line.append(f"{label} ", "dim")
        line.append(f"{n}", style)
        line.append("  ")
    if tier.bytes is not None:
        line.append(human_bytes(tier.bytes), "dim")
        line.append("  ")
    room = width - line.cell_len
    if room >= 8 and tier.spark:
        line.append(spark(tier.spark, room, lo=0, hi=max(tier.capacity, max(tier.spark))), color)
    return line
