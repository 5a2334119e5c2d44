"""What the detail views say about a finding, a block or a sequence, built from the monitor.

These run on the UI thread through ``Feed.query`` (under the feed's lock) and return rich
``Text``, so a detail view costs nothing until someone opens it.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from ..findings import Finding
from .blocks import LEAKED, STALE, UNOWNED
from .render import SEVERITY_STYLE, event_fields, event_kind
from .state import Monitor

__all__ = ["describe_finding", "describe_block", "describe_seq", "block_story_of", "seq_story_of"]

_NBSP = "\u00a0"  # indentation that survives wrapping


def describe_finding(f: Finding, block_story: list[Any] | None = None, seq_story: dict[str, Any] | None = None) -> Text:
    """A finding as the detail pane shows it; ``block_story`` and ``seq_story`` come from the monitor."""
    out = Text()
    style = SEVERITY_STYLE.get(f.severity, "")
    out.append(f"{f.severity.upper()} ", style)
    out.append(f"{f.check}/{f.rule}\n", "bold")
    out.append(f"{f.message}\n")
    where = [(k, v) for k, v in (("step", f.step), ("seq", f.seq), ("block", f.block), ("layer", f.layer),
                                 ("trace", f.trace)) if v is not None]
    if where:
        out.append("  ".join(f"{k} {v}" for k, v in where) + "\n", "cyan")
    if f.evidence:
        out.append("\nevidence\n", "bold underline")
        for key, value in f.evidence.items():
            out.append_text(_value(key, value))
    if seq_story:
        out.append("\nsequence\n", "bold underline")
        for key, value in seq_story.items():
            if key != "stack":
                out.append(f"{_NBSP * 2}{key}: {value}\n")
    if block_story:
        out.append("\nblock history (newest last)\n", "bold underline")
        for ev in block_story:
            out.append(f"{_NBSP * 2}{ev.step:>6} ", "dim")
            out.append(f"{event_kind(ev):<10}", "bold")
            out.append(f" {event_fields(ev)}\n")
    stacks = _stacks(f, block_story, seq_story)
    if stacks:
        live = bool(f.attribution.get("stacks") or f.attribution.get("stack"))
        out.append("\nPython stack " + ("(py-spy, as the finding was made)" if live else "(recorded with the event)")
                   + "\n", "bold underline")
        for frame in stacks:
            out.append(f"{_NBSP * 2}{frame}\n", "green")
    if f.attribution:
        out.append("\nattribution\n", "bold underline")
        for key, value in f.attribution.items():
            if key not in ("stack", "stacks"):
                out.append_text(_value(key, value))
    return out


def _stacks(f: Finding, block_story: list[Any] | None, seq_story: dict[str, Any] | None) -> list[str]:
    """The best Python stack known: attribution first, then the alloc's or the sequence's own."""
    for key in ("stack", "stacks"):
        value = f.attribution.get(key)
        if isinstance(value, list) and value:
            return [str(x) for x in value]
        if isinstance(value, dict) and value:
            return [f"{k}: {v}" for k, v in value.items()]
    for ev in block_story or ():
        stack = getattr(ev, "stack", None)
        if stack:
            return list(stack)
    if seq_story and seq_story.get("stack"):
        return list(seq_story["stack"])
    return []


def _value(key: str, value: Any, indent: str = _NBSP * 2) -> Text:
    out = Text()
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out.append(f"{indent}{key}:\n", "bold")
        for item in value[-24:]:
            kind = item.get("kind", "")
            rest = " ".join(f"{k}={v}" for k, v in item.items() if k not in ("kind", "t", "step") and v is not None)
            out.append(f"{indent}{_NBSP * 2}{item.get('step', ''):>6} ", "dim")
            out.append(f"{kind:<10}", "bold")
            out.append(f" {rest}\n")
        return out
    if isinstance(value, dict):
        out.append(f"{indent}{key}:\n", "bold")
        for k, v in value.items():
            out.append_text(_value(str(k), v, indent + _NBSP * 2))
        return out
    out.append(f"{indent}{key}: ", "bold")
    out.append(f"{value}\n")
    return out


def block_story_of(m: Monitor, block: int) -> list[Any] | None:
    rec = m.blocks.records.get(block)
    if rec is None:
        return None
    history = list(rec.history)
    if rec.born is not None and rec.born not in history:
        history.insert(0, rec.born)
    return history


def seq_story_of(m: Monitor, seq: Any) -> dict[str, Any] | None:
    rec = m.seq(seq) if seq is not None else None
    if rec is None:
        return None
    state = "running" if rec.end_step is None else f"{rec.reason} at step {rec.end_step}"
    return {
        "seq": rec.seq, "state": state, "started": f"step {rec.start_step}", "prompt tokens": rec.prompt_len,
        "cached tokens": rec.length, "version": rec.version, "blocks": sorted(rec.blocks), "stack": rec.stack,
    }


def describe_block(m: Monitor, block: int) -> Text | None:
    rec = m.blocks.records.get(block)
    if rec is None:
        return None
    out = Text()
    tier = ("free", "device", "host", "disk")[rec.tier]
    out.append(f"block {block}", "bold")
    out.append(f"  {tier}", "bold cyan")
    if rec.codec is not None:
        out.append(f" {rec.codec}", "cyan")
    flags = [n for f, n in ((UNOWNED, "unowned"), (LEAKED, "leaked"), (STALE, "stale")) if rec.flags & f]
    if flags:
        out.append("  " + " ".join(flags), "bold red")
    out.append(f"\nowners: {', '.join(sorted(map(str, rec.owners))) or 'none'}   version: {rec.version}")
    out.append(f"   last read at step: {'-' if rec.last_read_step is None else rec.last_read_step}\n")
    mine = [f for f in m.findings if f.block == block]
    if mine:
        out.append("\nfindings\n", "bold underline")
        for f in mine[-10:]:
            out.append(f"{_NBSP * 2}{f.severity:<8} step {f.step}: {f.check}/{f.rule} {f.message}\n")
    out.append("\nhistory (newest last)\n", "bold underline")
    for ev in block_story_of(m, block) or ():
        out.append(f"{_NBSP * 2}{ev.step:>6} ", "dim")
        out.append(f"{event_kind(ev):<10}", "bold")
        out.append(f" {event_fields(ev)}\n")
    stack = rec.born.stack if rec.born is not None else None
    if stack:
        out.append("\nallocated from\n", "bold underline")
        for frame in stack:
            out.append(f"{_NBSP * 2}{frame}\n", "green")
    return out


def describe_seq(m: Monitor, key: str) -> Text | None:
    rec = m.find_seq(key)
    if rec is None:
        return None
    story = seq_story_of(m, rec.seq) or {}
    out = Text()
    for k, v in story.items():
        if k != "stack":
            out.append(f"{k}: ", "bold")
            out.append(f"{v}\n")
    mine = [f for f in m.findings if f.seq == rec.seq]
    if mine:
        out.append("\nfindings\n", "bold underline")
        for f in mine[-10:]:
            out.append(f"{_NBSP * 2}{f.severity:<8} step {f.step}: {f.check}/{f.rule} {f.message}\n")
    if rec.stack:
        out.append("\nadmitted from\n", "bold underline")
        for frame in rec.stack:
            out.append(f"{_NBSP * 2}{frame}\n", "green")
    return out
