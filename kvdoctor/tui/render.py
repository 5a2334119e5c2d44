"""Small text renderers shared by the widgets: sparklines, sizes, rates, event lines.

Sparklines are plain strings of block characters, so a widget can place one in any
line it draws and colour single cells (an anomaly, a leak) without a widget per curve.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..events import Unknown, to_dict

__all__ = ["spark", "spark_levels", "human_bytes", "human_rate", "event_kind", "event_fields", "SEVERITY_STYLE"]

_BARS = "▁▂▃▄▅▆▇█"

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def spark_levels(values: Sequence[float], width: int, lo: float | None = None, hi: float | None = None) -> list[int]:
    """The last ``width`` values scaled to 0..7 (-1 for a value that is not finite)."""
    vals = list(values[-width:]) if width > 0 else []
    finite = [v for v in vals if math.isfinite(v)]
    if not finite:
        return [-1] * len(vals)
    low = min(finite) if lo is None else lo
    high = max(finite) if hi is None else hi
    span = high - low
    out = []
    for v in vals:
        if not math.isfinite(v):
            out.append(-1)
        elif span <= 0:
            out.append(3 if v else 0)
        else:
            out.append(min(7, max(0, int((v - low) / span * 7.999))))
    return out


def spark(values: Sequence[float], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """A sparkline of the last ``width`` values, left-padded with spaces to ``width``; ✖ marks NaN/inf."""
    levels = spark_levels(values, width, lo, hi)
    return " " * (width - len(levels)) + "".join("✖" if k < 0 else _BARS[k] for k in levels)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def event_kind(ev: Any) -> str:
    return ev.kind if type(ev) is Unknown else ev.__struct_config__.tag


def event_fields(ev: Any) -> str:
    """An event's own fields as ``key=value`` pairs (without kind, t and step), for one log line."""
    d = to_dict(ev)
    for key in ("kind", "t", "step", "stack"):
        d.pop(key, None)
    parts = []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, float):
            v = f"{v:.3g}"
        elif isinstance(v, list) and v and isinstance(v[0], list):  # a grid (attn_step's layers x rows): its shape
            v = f"[{len(v)}×{len(v[0])}]"
        elif isinstance(v, list) and len(v) > 8:
            v = "[" + ",".join(map(str, v[:8])) + f",…+{len(v) - 8}]"
        elif isinstance(v, list):
            v = "[" + ",".join(map(str, v)) + "]"
        parts.append(f"{k}={v}")
    return " ".join(parts)
