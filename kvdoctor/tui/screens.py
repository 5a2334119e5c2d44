"""Modal screens: help, a one-line prompt (search, filter, seek) and a detail view."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

__all__ = ["HelpScreen", "PromptScreen", "DetailScreen", "HELP"]

HELP = """\
[b]kvdoctor[/b] — a live view of an LLM's KV cache

[b]1[/b] overview  [b]2[/b] findings  [b]3[/b] attention  [b]4[/b] memory  [b]5[/b] events  [b]6[/b] output
(or click a tab)

[b]p[/b] space  pause the display (checks keep running); replay: play/pause
[b]/[/b]        filter the log: swap  -attn  seq=3  block=17
[b]s[/b]        search: b17 (block), s3 (sequence), 17 (block)
[b]d[/b] enter  details of the finding or block selected
[b]↑↓[/b] [b]jk[/b]    move;  [b]tab[/b] next pane;  the mouse works too
[b]?[/b]        this help;  [b]q[/b] quit (stops a workload kvdoctor started)
[b]n b g[/b]    replay: next step, previous step, go to step
[b]t T[/b]      a workload of several traces: show the next, the previous one

[green]█[/]dev [dodger_blue1]▓[/]host [magenta]▒[/]disk [b]▞[/]shared \
[bold white on red]L[/]leaked [bold black on yellow]S[/]stale ·free
Findings: [bold red]E[/]rror [yellow]W[/]arning [cyan]I[/]nfo, newest first
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 78; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP.rstrip())

    def on_click(self) -> None:
        self.dismiss()


class PromptScreen(ModalScreen[str | None]):
    """Asks for one line; dismisses with the text, or None on escape."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    PromptScreen { align: center middle; }
    PromptScreen > Vertical { width: 60; height: auto; border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, title: str, placeholder: str = "", value: str = "") -> None:
        super().__init__()
        self._title, self._placeholder, self._value = title, placeholder, value

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title)
            yield Input(value=self._value, placeholder=self._placeholder)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class DetailScreen(ModalScreen[None]):
    """A block, a sequence or a finding in full; escape closes."""

    BINDINGS = [Binding("escape,q,enter,d", "dismiss", "Close")]
    DEFAULT_CSS = """
    DetailScreen { align: center middle; }
    DetailScreen > VerticalScroll { width: 95%; height: 90%; border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, title: str, body: Text) -> None:
        super().__init__()
        self._title, self._body = title, body

    def compose(self) -> ComposeResult:
        scroll = VerticalScroll()
        scroll.border_title = self._title
        scroll.border_subtitle = "esc closes"
        with scroll:
            yield Static(self._body)
