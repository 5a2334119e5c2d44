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

    snapshot: reactive[Snapshot | None] = reactive(None)

    def watch_snapshot(self) -> None:
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
        for k, step, v in zip(spark_levels(vals, graph), steps, vals):
            if k < 0:
                line.append("✖", "bold white on red")
            else:
                line.append(_BARS[k], "bold red" if step in layer.anomalies else color)
        last = vals[-1] if vals else float("nan")
        line.append(f" {last:>7.3g} " if math.isfinite(last) else "     nan ", "bold" if vals else "dim")
    bad = sum(layer.nonfinite)
    if layer.anomalies:
        line.append(f"⚠ {len(layer.anomalies)} ", "bold red")
    if bad:
        line.append(f"✖ {bad}", "bold red")
    return line
