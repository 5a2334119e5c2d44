"""A scrolling list drawn with Textual's Line API: only the visible rows are ever rendered.

The findings list, the event log and the attention view can hold thousands of rows that
change many times a second; rebuilding a DataTable per update would cost the whole list
each time. ``LineList`` asks its subclass for one row's ``Text`` when that row is on screen,
and keeps an optional cursor that the keyboard and the mouse move.
"""

from __future__ import annotations

from typing import Any

from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

__all__ = ["LineList", "RowsView"]


class RowsView(ScrollView):
    """A ScrollView whose rows are drawn in the widget's style and within its scrollable region, both found once
    per paint (``base_style``, ``rows_region``).

    ``rich_style`` walks the styles of every ancestor up to the screen on each call, and the region is worked
    out from the scrollbars and the gutter on each call; asked once per row, the two were most of drawing a row,
    and a tab key draws every row of the pane it shows."""

    _base: Style | None = None
    _region: Region | None = None

    def render_lines(self, crop: Region) -> list[Strip]:
        self._base, self._region = self.rich_style, self.scrollable_content_region  # the rows of one paint share them
        try:
            return super().render_lines(crop)
        finally:
            self._base = self._region = None

    @property
    def base_style(self) -> Style:
        return self._base if self._base is not None else self.rich_style

    @property
    def rows_region(self) -> Region:
        return self._region if self._region is not None else self.scrollable_content_region


class LineList(RowsView, can_focus=True):
    """Rows from ``row_count``/``row_text``; a cursor when ``CURSOR`` is true."""

    CURSOR = True
    BINDINGS = [
        Binding("up,k", "move(-1)", "Up", show=False),
        Binding("down,j", "move(1)", "Down", show=False),
        Binding("pageup", "move(-10)", show=False),
        Binding("pagedown", "move(10)", show=False),
        Binding("home", "jump(0)", show=False),
        Binding("end", "jump(-1)", show=False),
    ]
    COMPONENT_CLASSES = {"linelist--cursor"}
    DEFAULT_CSS = """
    LineList { scrollbar-gutter: stable; overflow-x: hidden; }
    LineList > .linelist--cursor { background: $accent 40%; text-style: bold; }
    LineList:focus > .linelist--cursor { background: $accent; }
    """

    cursor: reactive[int] = reactive(0)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sized: Size | None = None  # the size the rows were last laid out for (``on_resize``)

    class Highlighted(Message):
        """The cursor moved to ``row``."""

        def __init__(self, sender: "LineList", row: int) -> None:
            super().__init__()
            self.sender = sender
            self.row = row

    class Chosen(Message):
        """Enter or a click on ``row``."""

        def __init__(self, sender: "LineList", row: int) -> None:
            super().__init__()
            self.sender = sender
            self.row = row

    # ---- subclasses provide ------------------------------------------------------------

    def row_count(self) -> int:
        raise NotImplementedError

    def row_text(self, row: int, width: int) -> Text:
        raise NotImplementedError

    # ---- sizing and drawing ------------------------------------------------------------

    def rows_changed(self) -> None:
        """Call when the rows changed: resizes the scroll area and redraws what is visible."""
        n = self.row_count()
        self.virtual_size = Size(self.scrollable_content_region.width, n)
        if self.CURSOR and n and self.cursor >= n:
            self.cursor = n - 1
        self.refresh()

    def on_resize(self, event: events.Resize) -> None:
        # A pane shown again is sent a Resize at the size it had; it is painted as it is shown, not twice.
        if event.size != self._sized:
            self._sized = event.size
            self.rows_changed()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = y + scroll_y
        width = self.rows_region.width
        base = self.base_style
        if row >= self.row_count():
            return Strip.blank(width, base)
        text = self.row_text(row, width)
        if self.CURSOR and row == self.cursor:
            text.stylize(self.get_component_rich_style("linelist--cursor"))
        strip = Strip(list(text.render(self.app.console))).apply_style(base)
        return strip.crop_extend(scroll_x, scroll_x + width, base)

    # ---- cursor --------------------------------------------------------------------------

    def watch_cursor(self, old: int, new: int) -> None:
        if not self.CURSOR:
            return
        self.refresh()
        self.scroll_to_region_row(new)
        self.post_message(self.Highlighted(self, new))

    def scroll_to_region_row(self, row: int) -> None:
        top = round(self.scroll_offset.y)
        height = self.scrollable_content_region.height
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif height and row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False)

    def action_move(self, delta: int) -> None:
        n = self.row_count()
        if self.CURSOR and n:
            self.cursor = min(max(self.cursor + delta, 0), n - 1)
        else:
            self.scroll_to(y=self.scroll_offset.y + delta, animate=False)

    def action_jump(self, row: int) -> None:
        n = self.row_count()
        target = n - 1 if row < 0 else row
        if self.CURSOR and n:
            self.cursor = min(max(target, 0), n - 1)
        else:
            self.scroll_to(y=max(target, 0), animate=False)

    def key_enter(self) -> None:
        if self.CURSOR and self.row_count():
            self.post_message(self.Chosen(self, self.cursor))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or not self.CURSOR:
            return
        row = offset.y + round(self.scroll_offset.y)
        if row < self.row_count():
            self.cursor = row
            if event.chain >= 2:
                self.post_message(self.Chosen(self, row))

