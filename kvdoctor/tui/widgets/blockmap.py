"""The block map: one cell per block, coloured by tier and state, leaked and stale blocks marked.

Thousands of blocks redraw many times a second, so the map is a Line API widget over the
snapshot's ``cells`` bytes: each visible row slices the bytes and maps each code to a
pre-built segment. Nothing is allocated per block per frame beyond that segment list, and a
new snapshot redraws only the rows whose cells changed.
"""

from __future__ import annotations

from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip

from ..blocks import CACHED, LEAKED, SHARED, STALE, UNOWNED
from ..state import Snapshot
from .lines import RowsView

__all__ = ["BlockMap", "LEGEND"]

_TIER = {1: ("█", "green"), 2: ("▓", "dodger_blue1"), 3: ("▒", "magenta")}
LEGEND = "[green]█[/]dev [dodger_blue1]▓[/]host [magenta]▒[/]disk [bold]▞[/]shared " \
         "[bold white on red]L[/]leak [bold black on yellow]S[/]stale"
CACHED_LEGEND = LEGEND + " [bold]▚[/]cached"  # once the trace shows a prefix cache


def _segment(code: int) -> Segment:
    tier = code & 3
    if tier == 0:
        return Segment("·", Style(color="grey37"))
    glyph, color = _TIER[tier]
    if code & (LEAKED | UNOWNED):
        return Segment("L", Style(color="white", bgcolor="red", bold=True))
    if code & STALE:
        return Segment("S", Style(color="black", bgcolor="yellow", bold=True))
    if code & CACHED:
        return Segment("▚", Style(color=color, bold=True, underline=True))
    if code & SHARED:
        return Segment("▞", Style(color=color, bold=True))
    return Segment(glyph, Style(color=color))


_SEGMENTS = [_segment(code) for code in range(256)]
_WIDE = 3  # characters per cell when there is room: the glyph twice and a gap
_WIDE_SEGMENTS = [Segment(seg.text * 2 if seg.text in "█▓▒▞▚" else seg.text + " ", seg.style) for seg in _SEGMENTS]
_GAP = Segment(" ")


class BlockMap(RowsView, can_focus=True):
    """Cells in the order blocks were first seen; a click (or ``selected``) picks one."""

    # The gutter is kept even without a scrollbar: a scrollbar arriving would narrow the content
    # without a resize event, leaving rows laid out for a width that no longer shows.
    DEFAULT_CSS = """
    BlockMap { height: 1fr; overflow-x: hidden; scrollbar-gutter: stable; }
    """

    snapshot: reactive[Snapshot | None] = reactive(None, repaint=False)
    selected: reactive[int | None] = reactive(None)  # a block id

    class Picked(Message):
        def __init__(self, block: int) -> None:
            super().__init__()
            self.block = block

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sized: Size | None = None  # the size the rows were last laid out for (``on_resize``)

    def _layout(self, snapshot: Snapshot | None = None) -> tuple[int, int]:
        """(characters per cell, cells per row) for ``snapshot`` (the one shown by default): a few blocks get wide
        cells, thousands one character each."""
        region = self.rows_region
        width = max(region.width, 1)
        height = max(region.height, 1)
        snapshot = snapshot or self.snapshot
        n = len(snapshot.cells) if snapshot is not None else 0
        wide = width // _WIDE
        if wide and n <= wide * height:
            return _WIDE, wide
        return 1, width

    def watch_snapshot(self, old: Snapshot | None, new: Snapshot | None) -> None:
        if new is not None and new.prefix_lookups:
            self.border_subtitle = CACHED_LEGEND
        if old is None or new is None or self._layout(old) != self._layout(new) or (
                self.selected is not None and old.cell_ids is not new.cell_ids):  # the selected cell may have moved
            self._resize()
            return
        self._set_rows()
        self._refresh_changed(old.cells, new.cells)

    def _refresh_changed(self, before: bytes, after: bytes) -> None:
        """Redraw the rows on screen whose cells differ: between two steps most of the map stays as it was."""
        if before == after:
            return
        _, per_row = self._layout()
        top = round(self.scroll_offset.y)
        start = None
        for row in range(top, top + self.scrollable_content_region.height + 1):
            lo = row * per_row
            changed = before[lo:lo + per_row] != after[lo:lo + per_row]
            if changed and start is None:
                start = row
            elif not changed and start is not None:
                self.refresh_lines(start, row - start)
                start = None
        if start is not None:
            self.refresh_lines(start, top + self.scrollable_content_region.height + 1 - start)

    def watch_selected(self) -> None:
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        # A pane shown again is sent a Resize at the size it had; it is painted as it is shown, not twice.
        if event.size != self._sized:
            self._sized = event.size
            self._resize()

    def _resize(self) -> None:
        self._set_rows()
        self.refresh()

    def _set_rows(self) -> None:
        n = len(self.snapshot.cells) if self.snapshot is not None else 0
        _, per_row = self._layout()
        self.virtual_size = Size(self.scrollable_content_region.width, -(-n // per_row))

    def render_line(self, y: int) -> Strip:
        width = max(self.rows_region.width, 1)
        base = self.base_style
        s = self.snapshot
        if s is None:
            return Strip.blank(width, base)
        cell_width, per_row = self._layout()
        start = (y + round(self.scroll_offset.y)) * per_row
        cells = s.cells[start:start + per_row]
        if not cells:
            return Strip.blank(width, base)
        table = _SEGMENTS if cell_width == 1 else _WIDE_SEGMENTS
        segments = [table[c] for c in cells]
        if self.selected is not None:
            try:
                i = s.cell_ids.index(self.selected, start, start + len(cells))
            except ValueError:
                pass
            else:
                seg = segments[i - start]
                segments[i - start] = Segment(seg.text, (seg.style or Style()) + Style(reverse=True))
        if cell_width > 1:  # a gap after each wide cell keeps neighbouring blocks apart
            segments = [part for seg in segments for part in (seg, _GAP)]
        return Strip(segments, len(cells) * cell_width).apply_style(base).extend_cell_length(width, base)

    def block_at(self, x: int, y: int) -> int | None:
        """The block id drawn at content offset (x, y), if any."""
        s = self.snapshot
        if s is None:
            return None
        cell_width, per_row = self._layout()
        column = x // cell_width
        if column >= per_row:
            return None
        i = (y + round(self.scroll_offset.y)) * per_row + column
        return s.cell_ids[i] if 0 <= i < len(s.cell_ids) else None

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        block = self.block_at(offset.x, offset.y)
        if block is not None:
            self.selected = block
            self.post_message(self.Picked(block))
