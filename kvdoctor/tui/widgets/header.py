"""The two lines at the top: what is being watched and how fast, then the feed's state."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..render import SEVERITY_STYLE, human_rate
from ..state import Snapshot

__all__ = ["StatusHeader"]


class StatusHeader(Widget):
    DEFAULT_CSS = """
    StatusHeader { height: 2; background: $panel; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)
    paused: reactive[bool] = reactive(False, repaint=False)

    def __init__(self, *, show_pid: bool = True, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.show_pid = show_pid  # off in tests: a pid differs on every run
        self._text: Text | None = None  # as last drawn

    def watch_snapshot(self) -> None:
        self._update()

    def watch_paused(self) -> None:
        self._update()

    def _update(self) -> None:
        """Drawn again only when its words changed: most frames between two steps change nothing here."""
        text = self._lines()
        if text != self._text:
            self._text = text
            self.refresh()

    def render(self) -> Text:
        if self._text is None:
            self._text = self._lines()
        return self._text

    def _lines(self) -> Text:
        out = self._identity()
        out.append("\n")
        out.append_text(self._state())
        return out

    def _identity(self) -> Text:
        s = self.snapshot
        line = Text()
        line.append("kvdoctor", "bold")
        if s is None:
            line.append("  starting…", "dim")
            return line
        h = s.header
        parts: list[tuple[str, str]] = []
        if h is not None and h.pid is not None and self.show_pid:
            parts.append((f"pid {h.pid}", ""))
        if h is not None and h.model:
            parts.append((h.model.rsplit("/", 1)[-1], "bold cyan"))
        if not s.steps_done and not s.step and not s.ended:
            # No step yet: a workload loading its model (no header) or running its first step. Rates of 0
            # for 10-20 s would read as a hung engine.
            parts.append(("loading model…" if h is None else "running the first step…", "bold yellow"))
        else:
            parts += [(f"step {s.step}", ""), (f"{human_rate(s.tokens_per_s)} tok/s", ""),
                      (f"{human_rate(s.events_per_s)} ev/s", ""), (f"{s.active_seqs}/{s.num_seqs} seqs", "")]
        rate = s.prefix_hit_rate
        if rate is not None:  # prompt blocks served from a prefix cache, of those looked up
            parts.append((f"prefix hit {rate:.0%}", "bold green" if rate >= 0.5 else ""))
        for text, style in parts:
            line.append(" │ ", "dim")
            line.append(text, style)
        return line

    def _state(self) -> Text:
        s = self.snapshot
        line = Text()
        if self.paused:
            line.append(" PAUSED ", "bold black on yellow")
            line.append(" ")
        if s is None:
            return line
        counts = [(n, sev) for sev, n in s.num_findings.items() if n]
        if not counts:
            line.append("no findings", "green")
        for i, (n, sev) in enumerate(counts):
            line.append((" " if i else "") + f"{n} {sev}{'s' if n != 1 else ''}", SEVERITY_STYLE[sev])
        line.append(" │ ", "dim")
        if s.ended:
            crashed = any(w in s.ended for w in ("crash", "killed", "unreadable", "error", "no such", "not a", "no trace"))
            line.append(f"■ {s.ended}", "bold red" if crashed else "bold yellow")
            line.append(" — last state kept, browse freely", "dim")
        elif s.status:
            line.append(f"● {s.status}", "green")
        return line
