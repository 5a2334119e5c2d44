"""``kvdoctor check --format html``: one self-contained page for a CI artifact.

The page holds the findings table, each finding's block history, and plots of tier usage,
swaps and findings over steps drawn as inline SVG here: no script, no stylesheet and no
font from the network, so it opens the same offline years later. The plots need what the
``Report`` does not keep, the per-step series, which ``StepSeries`` gathers as the events
pass through the session.
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .events import StepEnd, SwapIn, SwapOut, Usage
from .findings import SEVERITIES
from .report import Report, _more, _story, _where, summary_line

__all__ = ["StepSeries", "render_html"]

_W, _H, _PAD = 640, 180, 36
_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
_SEV_COLOUR = {"error": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


@dataclass
class StepSeries:
    """Per-step tier usage (blocks used at the step's last reading) and swaps, from events."""

    used: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    swaps_out: Counter = field(default_factory=Counter)
    swaps_in: Counter = field(default_factory=Counter)
    last_step: int = 0

    def observe(self, event: Any) -> None:
        kind = type(event)
        if kind is Usage:
            self.used[event.tier][event.step] = event.used_blocks
        elif kind is SwapOut:
            self.swaps_out[event.step] += 1
        elif kind is SwapIn:
            self.swaps_in[event.step] += 1
        if kind is StepEnd or kind is Usage:
            self.last_step = max(self.last_step, event.step)

    def observe_many(self, events: Iterable[Any]) -> None:
        for e in events:
            self.observe(e)


def _plot(title: str, series: dict[str, dict[int, int]], last_step: int, *, bars: bool = False) -> str:
    """A line (or bar) chart of ``{name: {step: value}}`` over steps 0..last_step as SVG."""
    top = max([v for s in series.values() for v in s.values()] + [1])
    span = max(last_step, 1)

    def x(step: float) -> float:
        return _PAD + (_W - 2 * _PAD) * step / span

    def y(value: float) -> float:
        return _H - _PAD + (-(_H - 2 * _PAD) * value / top)

    parts = [f'<svg role="img" class="plot" width="{_W}" height="{_H}" '
             f'viewBox="0 0 {_W} {_H}"><title>{html.escape(title)}</title>',
             f'<text x="{_PAD}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="#444"/>',
             f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="#444"/>',
             f'<text x="{_PAD - 4}" y="{_PAD + 4}" font-size="10" text-anchor="end">{top}</text>',
             f'<text x="{_PAD - 4}" y="{_H - _PAD}" font-size="10" text-anchor="end">0</text>',
             f'<text x="{_W - _PAD}" y="{_H - _PAD + 14}" font-size="10" text-anchor="end">step {last_step}</text>']
    bar_w = max((_W - 2 * _PAD) / (span + 1) / max(len(series), 1), 1.0)
    for i, (name, points) in enumerate(sorted(series.items())):
        colour = _SEV_COLOUR.get(name, _COLOURS[i % len(_COLOURS)])
        if bars:
            parts += [f'<rect x="{x(s) + i * bar_w:.1f}" y="{y(v):.1f}" width="{bar_w:.1f}" '
                      f'height="{_H - _PAD - y(v):.1f}" fill="{colour}"><title>{html.escape(name)} '
                      f'step {s}: {v}</title></rect>' for s, v in sorted(points.items()) if v]
        elif points:
            path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in sorted(points.items()))
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
        parts.append(f'<text x="{_W - _PAD + 4}" y="{_PAD + 12 * i}" font-size="10" fill="{colour}">'
                     f'{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


_CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top;font-size:13px}
.error{color:#d62728;font-weight:bold}.warning{color:#b35900}.info{color:#1f77b4}
code{font-size:12px;white-space:pre-wrap}svg.plot{display:block;margin:0.5em 0}"""


def render_html(report: Report, series: StepSeries | None = None) -> str:
    """The report as one HTML page with inline CSS and SVG (and nothing fetched at view time)."""
    series = series or StepSeries()
    last = max([series.last_step] + [f.step for f in report.findings if f.step is not None])
    by_sev: dict[str, dict[int, int]] = {s: {} for s in SEVERITIES}
    for f in report.findings:
        if f.step is not None:
            by_sev[f.severity][f.step] = by_sev[f.severity].get(f.step, 0) + 1
    out = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
           f"<title>kvdoctor report: {html.escape(str(report.source or 'events'))}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>kvdoctor check: {html.escape(str(report.source or 'events'))}</h1>",
           f"<p>{report.num_events} events. <b>{html.escape(summary_line(report))}</b> "
           f"(fail on {html.escape(report.fail_on)})</p>"]
    out += [f"<p>note: {html.escape(n)}</p>" for n in report.notes]
    out.append("<h2>Over steps</h2>")
    out.append(_plot("tier usage (blocks)", dict(series.used), last))
    out.append(_plot("swaps per step", {"swap_out": dict(series.swaps_out), "swap_in": dict(series.swaps_in)},
                     last, bars=True))
    out.append(_plot("findings per step", {s: v for s, v in by_sev.items() if v}, last, bars=True))
    out.append(f"<h2>Findings ({len(report.findings)})</h2>")
    if report.findings:
        out.append("<table><tr><th>#</th><th>severity</th><th>check/rule</th><th>where</th>"
                   "<th>message</th><th>block history</th></tr>")
        for i, f in enumerate(report.findings, 1):
            history = f.evidence.get("history")
            story = f"<code>{html.escape(_story(history))}</code>" if history else ""
            code = "".join(f"<br><code>{html.escape(line)}</code>" for line in _more(f))
            out.append(f'<tr class="finding"><td>{i}</td><td class="{f.severity}">{f.severity}</td>'
                       f"<td>{html.escape(f.check)}/{html.escape(f.rule)}</td><td>{html.escape(_where(f))}</td>"
                       f"<td>{html.escape(f.message)}{code}</td><td>{story}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No findings.</p>")
    if report.suppressed:
        out.append(f"<p>{report.suppressed} further findings over the per-rule cap were counted but not listed.</p>")
    if report.baselined:
        out.append(f"<p>{report.baselined} findings accepted by the baseline were not listed.</p>")
    out.append("</body></html>\n")
    return "\n".join(out)
