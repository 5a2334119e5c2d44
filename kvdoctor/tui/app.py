"""The kvdoctor Textual app: live (or replayed) KV-cache state on a few keyboard-driven screens.

The app owns no source. It starts a ``Feed`` (a thread that reads events and runs the
checks) and receives ``Snapshot``s from it as messages; setting ``snapshot`` (a reactive)
hands the same immutable snapshot to the header and to the views of the screen shown, so
widgets draw from state and never poll. A hidden screen's views are handed the newest
snapshot as the screen is shown, before it is painted: frames cost what one screen draws,
not all six. Pausing only stops applying snapshots: the feed, and the checks, go on seeing
every event.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from typing import Any, Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import Reactive, reactive
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import ContentSwitcher, Input, TabbedContent, TabPane

from ..findings import Finding
from .feed import BusFeed, CheckerFactory, Feed, ReplayFeed, all_checks
from .details import block_story_of, describe_block, describe_finding, describe_seq, seq_story_of
from .screens import DetailScreen, HelpScreen, PromptScreen
from .state import Monitor, Snapshot
from .traces import WorkloadFeed
from .widgets.attention import AttentionView
from .widgets.blockmap import LEGEND, BlockMap
from .widgets.eventlog import EventLog
from .widgets.findings import FindingDetail, FindingsList, RecentFindings
from .widgets.footer import KeysFooter
from .widgets.gauges import TierGauges
from .widgets.header import StatusHeader
from .widgets.memory import MemoryView
from .widgets.output import OutputView
from .widgets.traces import TraceBar
from .workload import Workload

__all__ = ["KvdoctorApp", "SnapshotReady", "bus_app", "watch_bus", "workload_app"]

TABS = ("overview", "findings", "attention", "memory", "events", "output")
_MAIN_WIDGET = {"overview": "blocks", "findings": "findings-list", "attention-tab": "attention",
                "memory-tab": "memory", "events": "log", "output": "output-pane"}


class SnapshotReady(Message):
    """Posted by the feed's thread when a snapshot waits to be shown (the app's newest, ``KvdoctorApp._publish``)."""


class _MainScreen(Screen):
    """The app's screen. A focus move repaints the two widgets it concerns (their focus styles), not the whole
    screen: a tab key moves focus, and a whole repaint on top of the new pane's was a sixth of its time."""

    focused: Reactive[Widget | None] = Reactive(None, repaint=False)


class _Backdrop:
    """A container wholly covered by what it holds (the tabbed content, its switcher, the panes and the rows that
    lay panels side by side): drawn as its background alone (Textual's ``BLANK``), never as content. A tab key
    repaints the whole pane area, and the compositor draws every widget under it, the covered ones too: their
    backgrounds, drawn as content, were ~5 ms of the key's ~33 ms of CPU."""

    BLANK = True


class _TabbedContent(_Backdrop, TabbedContent):
    def on_mount(self) -> None:
        self.query_one(ContentSwitcher).BLANK = True  # type: ignore[misc]  # Textual's compose makes it


class _TabPane(_Backdrop, TabPane):
    pass


class _Vertical(_Backdrop, Vertical):
    pass


class _Horizontal(_Backdrop, Horizontal):
    pass


class KvdoctorApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "kvdoctor"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p,space", "pause", "Pause"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "search", "Search"),
        Binding("d", "detail", "Detail"),
        Binding("question_mark", "help", "Help"),
        Binding("n", "step(1)", "Next step"),
        Binding("b", "step(-1)", "Prev step"),
        Binding("g", "seek", "Go to step"),
        Binding("t", "trace(1)", "Next trace"),
        Binding("T", "trace(-1)", "Prev trace", show=False),
        *(Binding(str(i + 1), f"tab('{name}')", name.title(), show=False) for i, name in enumerate(TABS)),
    ]

    # No repaint of the whole screen per snapshot: each view redraws what changed in it.
    snapshot: reactive[Snapshot | None] = reactive(None, always_update=True, repaint=False)
    paused: reactive[bool] = reactive(False)

    def __init__(
        self,
        make_feed: Callable[[Callable[[Snapshot], None]], Feed],
        *,
        workload: Workload | None = None,
        show_pid: bool = True,
    ) -> None:
        super().__init__()
        # No animations: the tab bar's sliding underline alone took ~40 ms of the UI thread's CPU after each tab
        # key (18 frames in 0.3 s), more than the key itself, taken from the next key when the CPU is busy.
        self.animation_level = "none"
        self._make_feed = make_feed
        self.workload = workload
        self.show_pid = show_pid
        self.feed: Feed | None = None
        self._held: Snapshot | None = None  # the newest snapshot while paused
        self._next: Snapshot | None = None  # the newest snapshot the feed published, until the UI thread takes it
        self._next_lock = threading.Lock()
        self._frame_due = 0.0  # monotonic time before which no snapshot is drawn (``_frame_drawn``, ``_hold_frames``)
        self._views: dict[str, list[Widget]] = {}  # per screen (tab pane id), its widgets that draw a snapshot

    # ---- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusHeader(show_pid=self.show_pid).data_bind(KvdoctorApp.snapshot, KvdoctorApp.paused)
        yield TraceBar().data_bind(KvdoctorApp.snapshot)
        with _TabbedContent(initial="overview"):
            with _TabPane("1 Overview", id="overview"):
                gauges = TierGauges(id="tiers", classes="panel")
                gauges.border_title = "tiers"
                yield gauges
                with _Horizontal(id="overview-row"):
                    blocks = BlockMap(id="blocks", classes="panel")
                    blocks.border_title = "blocks"
                    blocks.border_subtitle = LEGEND
                    yield blocks
                    with VerticalScroll(id="recent", classes="panel") as recent:
                        recent.border_title = "findings (newest first)"
                        recent.border_subtitle = "2: every finding in full"
                        yield RecentFindings()
            with _TabPane("2 Findings", id="findings"):
                with _Vertical():
                    flist = FindingsList(id="findings-list", classes="panel")
                    flist.border_title = "findings (newest first) · enter: full detail"
                    yield flist
                    with VerticalScroll(id="finding-detail", classes="panel") as pane:
                        pane.border_title = "detail"
                        yield FindingDetail("select a finding", id="detail")
            with _TabPane("3 Attention", id="attention-tab"):
                att = AttentionView(id="attention", classes="panel")
                att.border_title = "attention per layer over steps"
                att.border_subtitle = "[bold red]▆[/] anomaly  [bold white on red]✖[/] non-finite"
                yield att
            with _TabPane("4 Memory", id="memory-tab"):
                with VerticalScroll(id="memory", classes="panel") as mem:
                    mem.border_title = "memory timeline"
                    yield MemoryView()
            with _TabPane("5 Events", id="events"):
                filt = Input(placeholder="filter: swap  -attn  seq=3  block=17", id="filter")
                yield filt
                log = EventLog(id="log", classes="panel")
                log.border_title = "event log (newest last)"
                yield log
            with _TabPane("6 Output", id="output"):
                with VerticalScroll(id="output-pane", classes="panel") as out:
                    out.border_title = "the workload's output (newest last): the demo's answers"
                    yield OutputView()
        yield KeysFooter()

    def get_default_screen(self) -> Screen:
        return _MainScreen(id="_default")

    def on_mount(self) -> None:
        self._views = {pane.id or "": [w for w in pane.query(Widget) if _draws_snapshots(w)]
                       for pane in self.query(TabPane)}
        # What exists now (the modules, the screens' widgets) lives as long as the app: a full collection, which
        # stops every thread, then walks only what the feed makes from here on. Beside a busy CPU each one took
        # 0.1-0.2 s, every few seconds, and the keys it held up were the slowest tenth.
        gc.freeze()
        self.feed = self._make_feed(self._publish)
        self.feed.start()
        self.query_one("#blocks", BlockMap).focus()

    def on_unmount(self) -> None:
        gc.unfreeze()  # what the app held can be collected again once it is gone
        if self.feed is not None:
            self.feed.stop()
            self.feed.join(2.0)  # it stops within a slice of events
        if self.workload is not None:
            self.workload.stop()

    @property
    def replay(self) -> bool:
        return isinstance(self.feed, ReplayFeed)

    def _publish(self, snapshot: Snapshot) -> None:
        """Called on the feed's thread. At most one snapshot waits for the UI thread: a newer one replaces it. When
        the CPU is busy (the workload watched competes for it) and drawing a frame takes longer than the feed's
        frame interval, the screen skips to the newest state, and a key waits behind one frame at most, never a
        queue of them."""
        with self._next_lock:
            waiting = self._next is not None
            self._next = snapshot
        if not waiting:
            self.post_message(SnapshotReady())

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        wait = self._frame_due - time.monotonic()
        if wait > 0:  # the snapshot stays in ``_next`` (newer ones replace it) until the UI thread has had its rest
            if wait != math.inf:  # else a key's screen is being painted (``_hold_frames``)
                self.set_timer(wait, lambda: self.post_message(SnapshotReady()))
            return
        with self._next_lock:
            snapshot, self._next = self._next, None
        if snapshot is None:
            return
        if self.paused and not self.replay:
            self._held = snapshot
            return
        before = self.snapshot is not None and len(self.snapshot.traces) > 1
        self.snapshot = snapshot
        if before != (len(snapshot.traces) > 1):
            self.refresh_bindings()  # the trace keys appear with a workload's second trace
        self.call_after_refresh(self._frame_drawn, time.monotonic())

    def watch_snapshot(self) -> None:
        if self._views:
            self._show_views(self.query_one(TabbedContent).active)

    def _show_views(self, pane: str) -> None:
        """Hand the newest snapshot to the views of ``pane`` (a view handed the one it has does nothing)."""
        for view in self._views.get(pane, ()):
            view.snapshot = self.snapshot  # type: ignore[attr-defined]

    def _hold_frames(self) -> None:
        """No frame until the screen after this key is painted: the key's paint does not carry a frame's too."""
        self._frame_due = math.inf
        self.call_after_refresh(self._release_frames)

    def _release_frames(self) -> None:
        self._frame_due = time.monotonic()
        self.post_message(SnapshotReady())  # the newest snapshot, if one waited meanwhile

    def _frame_drawn(self, started: float) -> None:
        """A frame was applied and painted: the next waits as long as this one took. On a quiet machine a frame
        takes a few milliseconds and the feed's rate rules; when the workload watched keeps the CPU busy, a frame
        takes longer, and frames then use at most half of the UI thread's time, the rest left for keys (a frame
        a second at least, whatever held the screen up)."""
        now = time.monotonic()
        self._frame_due = now + min(now - started, 1.0)

    # ---- actions ----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("step", "seek"):
            return self.replay
        if action == "trace":  # shown only over a workload of several traces
            return self.snapshot is not None and len(self.snapshot.traces) > 1
        return True

    def action_pause(self) -> None:
        if isinstance(self.feed, ReplayFeed):
            self.feed.toggle()
            return
        self.paused = not self.paused
        if not self.paused and self._held is not None:
            self.snapshot, self._held = self._held, None

    def action_step(self, delta: int) -> None:
        if isinstance(self.feed, ReplayFeed):
            self.feed.step(delta)

    def action_trace(self, delta: int) -> None:
        """Show another trace of the workload: its block map, tiers, attention, memory and events."""
        if isinstance(self.feed, WorkloadFeed):
            self.feed.select(delta)

    def action_seek(self) -> None:
        def done(value: str | None) -> None:
            if value and value.lstrip("-").isdigit() and isinstance(self.feed, ReplayFeed):
                self.feed.seek(int(value))
            elif value:
                self.notify(f"not a step number: {value!r}", severity="warning")

        self.push_screen(PromptScreen("go to step", "a step number"), done)

    def action_tab(self, name: str) -> None:
        pane = {"attention": "attention-tab", "memory": "memory-tab"}.get(name, name)
        self._hold_frames()
        self._show_views(pane)  # before the switch: the pane's first paint is of the newest state
        self.query_one(TabbedContent).active = pane
        # Focus moves now, in one step (``focus()`` would wait for the next message): a focused widget left in a
        # hidden pane hands focus to a neighbour there, and the TabbedContent follows focus back to the old pane.
        target = self.query_one(f"#{_MAIN_WIDGET[pane]}")
        target.screen.set_focus(target)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._show_views(event.pane.id or "")  # a tab clicked (a key brought its pane up to date already)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        self.action_tab("events")
        self.query_one("#filter", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.query_one("#log", EventLog).filter_text = event.value

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self.query_one("#log", EventLog).focus()

    def action_search(self) -> None:
        def done(value: str | None) -> None:
            if value:
                self._open_search(value)

        self.push_screen(PromptScreen("search: a block (b17 or 17) or a sequence (s3)", "b17, s3, 17"), done)

    def _open_search(self, text: str) -> None:
        kind, _, key = _parse_query(text)
        if kind == "block" and key.isdigit():
            block = int(key)
            body = self._query(lambda m: describe_block(m, block))
            if body is not None:
                self.query_one("#blocks", BlockMap).selected = block
                self.push_screen(DetailScreen(f"block {block}", body))
                return
            if text.strip().isdigit():  # a bare number: maybe a sequence id
                kind = "seq"
        if kind == "seq":
            body = self._query(lambda m: describe_seq(m, key))
            if body is not None:
                self.push_screen(DetailScreen(f"sequence {key}", body))
                return
        self.notify(f"no {kind} {key} in what has been seen so far", severity="warning")

    def action_detail(self) -> None:
        focused = self.focused
        if isinstance(focused, BlockMap) and focused.selected is not None:
            self._open_search(f"b{focused.selected}")
            return
        flist = focused if isinstance(focused, FindingsList) else self.query_one("#findings-list", FindingsList)
        flist.snapshot = self.snapshot  # the list follows the feed only while its screen is shown
        f = flist.selected
        if f is None:
            self.notify("no finding selected", severity="information")
            return
        self.push_screen(DetailScreen(f"{f.check}/{f.rule}", self._describe(f)))

    def on_line_list_chosen(self, message: FindingsList.Chosen) -> None:
        if isinstance(message.sender, FindingsList):
            f = message.sender.finding(message.row)
            if f is not None:
                self.push_screen(DetailScreen(f"{f.check}/{f.rule}", self._describe(f)))

    def on_line_list_highlighted(self, message: FindingsList.Highlighted) -> None:
        if message.sender.id == "findings-list" and isinstance(message.sender, FindingsList):
            f = message.sender.finding(message.row)
            if f is not None:
                self.query_one("#detail", FindingDetail).update(self._describe(f))

    def on_block_map_picked(self, message: BlockMap.Picked) -> None:
        self._open_search(f"b{message.block}")

    # ---- helpers ----------------------------------------------------------------------

    def _query(self, fn: Callable[[Monitor], Any]) -> Any:
        return self.feed.query(fn) if self.feed is not None else None

    def _describe(self, f: Finding) -> Text:
        # a block's and a sequence's story are the shown trace's: told only for that trace's findings
        here = not isinstance(self.feed, WorkloadFeed) or self.feed.shows(f.trace)
        block_story = self._query(lambda m: block_story_of(m, f.block)) if f.block is not None and here else None
        seq_story = self._query(lambda m: seq_story_of(m, f.seq)) if f.seq is not None and here else None
        return describe_finding(f, block_story, seq_story)


def _draws_snapshots(widget: Widget) -> bool:
    return isinstance(getattr(type(widget), "snapshot", None), Reactive)


def _parse_query(text: str) -> tuple[str, str, str]:
    t = text.strip().lower()
    for prefix, kind in (("block", "block"), ("seq", "seq"), ("b", "block"), ("s", "seq")):
        if t.startswith(prefix) and t[len(prefix):].strip():
            return kind, prefix, text.strip()[len(prefix):].strip().lstrip("=#: ")
    return "block", "", text.strip()


def watch_bus(bus: Any, header: Any, target: Callable[[], Any], *,
              checker_factory: CheckerFactory | None = all_checks) -> None:
    """The TUI over an engine in this process: ``target`` (your serving loop) runs in a thread.

        cache = PagedKVCache(config)
        watch_bus(cache.bus, cache.header(), lambda: serve(cache))

    When ``target`` returns or raises, the header says so and the last state stays on screen.
    """
    bus_app(bus, header, target, checker_factory=checker_factory).run()


def bus_app(bus: Any, header: Any, target: Callable[[], Any], *,
            checker_factory: CheckerFactory | None = all_checks, show_pid: bool = True) -> KvdoctorApp:
    """The app ``watch_bus`` runs; ``target`` starts once the screen is up."""

    def make_feed(publish: Callable[[Snapshot], None]) -> Feed:
        feed = BusFeed(bus, header, publish, checker_factory=checker_factory)

        def work() -> None:
            reason = "the engine's work finished"
            try:
                target()
            except Exception as exc:  # shown on screen, where the user is looking
                reason = f"the engine's work raised {type(exc).__name__}: {exc}"
            finally:
                feed.close(reason)

        threading.Thread(target=work, name="kvdoctor-engine", daemon=True).start()
        return feed

    return KvdoctorApp(make_feed, show_pid=show_pid)


def workload_app(traces: Any, config: Any = None, *, workload: Workload | None = None,
                 metrics: Any = None) -> KvdoctorApp:
    """The app over every trace of a workload (a ``kvdoctor.workload.TraceSet``; ``watch --trace DIR``, ``-- CMD``,
    ``--pid``): each checked on its own and across the others, one shown at a time. ``workload``: the process
    kvdoctor started, if it did; ``metrics``: a ``kvdoctor.metrics.CacheMetrics`` to feed."""
    from ..config import Config
    from ..workload import WorkloadSession

    config = config if config is not None else Config()
    session = WorkloadSession(traces, config, name_traces=True)
    return KvdoctorApp(lambda publish: WorkloadFeed(session, publish, workload=workload, metrics=metrics,
                                                    limits=config.limits), workload=workload)
