"""The attention view: per layer, mean entropy and max logit over the last steps, anomalies marked.

A step with an attention finding at a layer is drawn in red in both curves of that layer,
and a step with non-finite scores as ✖, so a NaN or a collapse shows where and when it began.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.reactive import reactive

from ..render import spark_levels
from ..state import LayerView, Snapshot
from .lines import LineList

__all__ = ["AttentionView"]

_BARS = "▁▂▃▄▅▆▇█"


class AttentionView(LineList):
    CURSOR = False

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        # The curves move once a step: the snapshot hands the same layers until then.
        if old is None or new is None or old.layers is not new.layers:
            self.rows_changed()

    def row_count(self) -> int:
        s = self.snapshot
        return 1 + len(s.layers) if s is not None and s.layers else 1

    def row_text(self, row: int, width: int) -> Text:
        s = self.snapshot
        graph = max((width - 6 - 2 * 9 - 14) // 2, 4)
        if s is None or not s.layers:
            return Text("no attention statistics yet (attn events)", "dim")
        if row == 0:
            head = Text(no_wrap=True, overflow="crop")
            head.append("layer ", "bold")
            head.append(f"{'entropy (nats)':<{graph + 9}}", "bold")
            head.append(f"{'max logit':<{graph + 9}}", "bold")
            head.append("flags", "bold")
            return head
        return _layer_line(s.layers[row - 1], graph)


def _layer_line(layer: LayerView, graph: int) -> Text:
    line = Text(no_wrap=True, overflow="crop")
    line.append(f"L{layer.layer:<4} ", "bold")
    steps = layer.steps[-graph:]
    for values, color in ((layer.entropy, "cyan"), (layer.max_logit, "yellow")):
        vals = values[-graph:]
        line.append(" " * (graph - len(vals)))
        # One span per run of bars drawn alike, not one per bar: a line costs its runs to draw, not its width.
        run: list[str] = []
        run_style = ""
        for k, step, v in zip(spark_levels(vals, graph), steps, vals):
            glyph, style = ("✖", "bold white on red") if k < 0 else \
                (_BARS[k], "bold red" if step in layer.anomalies else color)
            if style != run_style and run:
                line.append("".join(run), run_style)
                run = []
            run.append(glyph)
            run_style = style
        if run:
            line.append("".join(run), run_style)
        last = vals[-1] if vals else float("nan")
        line.append(f" {last:>7.3g} " if math.isfinite(last) else "     nan ", "bold" if vals else "dim")
    bad = sum(layer.nonfinite)
    if layer.anomalies:
        line.append(f"⚠ {len(layer.anomalies)} ", "bold red")
    if bad:
        line.append(f"✖ {bad}", "bold red")
    return line
