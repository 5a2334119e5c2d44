"""The event log: the newest events, filtered, following the tail unless the user scrolls up.

Filter words are ANDed: a kind or its prefix (``swap``), ``-kind`` to hide one (``-attn``),
or ``field=value`` (``seq=3``, ``block=17``; a ``read`` matches a block among its blocks).
"""

from __future__ import annotations

from typing import Any, Callable

from rich.text import Text
from textual.reactive import reactive

from ...events import to_dict
from ..render import event_fields, event_kind
from ..state import Snapshot
from .lines import LineList

__all__ = ["EventLog", "compile_filter"]

_KIND_STYLE = {
    "alloc": "green", "free": "dim green", "evict": "yellow", "swap_out": "dodger_blue1", "swap_in": "cyan",
    "seq_start": "bold", "seq_end": "bold", "write": "", "read": "dim", "attn": "dim", "attn_step": "dim", "step_end": "dim",
    "checksum_error": "bold red", "io_error": "bold red", "trace_end": "bold yellow", "rollback": "magenta", "share": "bright_green",
    "release": "dim yellow",
}


def compile_filter(text: str) -> Callable[[Any], bool] | None:
    """A predicate over events for the filter text; ``None`` keeps everything."""
    words = text.split()
    if not words:
        return None
    kinds = [w for w in words if "=" not in w and not w.startswith("-")]
    hidden = [w[1:] for w in words if w.startswith("-") and len(w) > 1]
    fields = [tuple(w.split("=", 1)) for w in words if "=" in w]

    def keep(ev: Any) -> bool:
        kind = event_kind(ev)
        if kinds and not any(kind.startswith(k) for k in kinds):
            return False
        if any(kind.startswith(h) for h in hidden):
            return False
        if fields:
            d = to_dict(ev)
            for key, want in fields:
                have = d.get(key, d.get(key + "s"))
                if isinstance(have, list):
                    if want not in map(str, have):
                        return False
                elif str(have) != want:
                    return False
        return True

    return keep


class EventLog(LineList):
    CURSOR = False

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)
    filter_text: reactive[str] = reactive("")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rows: list[Any] = []
        self._follow = True

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        if old is None or new is None or old.log is not new.log:  # the same tuple: no event since
            self._refilter()

    def watch_filter_text(self) -> None:
        self._refilter()

    def _refilter(self) -> None:
        log = self.snapshot.log if self.snapshot is not None else ()
        keep = compile_filter(self.filter_text)
        self._rows = list(log) if keep is None else [ev for ev in log if keep(ev)]
        self.rows_changed()

    def rows_changed(self) -> None:
        super().rows_changed()
        if self._follow:
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True)

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        # Scrolled up by the user: stop following the tail until they come back to the bottom.
        self._follow = new >= self.max_scroll_y - 1

    def row_count(self) -> int:
        return len(self._rows)

    def row_text(self, row: int, width: int) -> Text:
        ev = self._rows[row]
        kind = event_kind(ev)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{ev.step:>7} ", "dim")
        line.append(f"{kind:<11}", _KIND_STYLE.get(kind, "bold"))
        line.append(event_fields(ev))
        return line
