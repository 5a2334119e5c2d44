"""Helpers of the TUI tests: synthetic traces on disk, apps over them, waiting for the feed."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from kvdoctor.trace import TraceWriter
from kvdoctor.tui.app import KvdoctorApp
from kvdoctor.tui.feed import LiveFeed, ReplayFeed
from kvdoctor.tui.synthetic import SyntheticWorkload
from kvdoctor.tui.traces import WorkloadFeed
from kvdoctor.tui.workload import Workload
from kvdoctor.workload import TraceSet, WorkloadSession

RECORDED = Path(__file__).resolve().parent.parent / "data" / "tui-demo-leak-swapped.kvtrace"


def write_synthetic(path: Path, **kwargs: Any) -> Path:
    w = SyntheticWorkload(**kwargs)
    with TraceWriter(path, w.header()) as writer:
        writer.write_many(list(w.events()))
    return path


def replay_app(path: Path, **feed_kwargs: Any) -> KvdoctorApp:
    """An app replaying ``path`` to its end at once (speed 0), without pids in the header."""
    feed_kwargs.setdefault("speed", 0)
    return KvdoctorApp(lambda publish: ReplayFeed(str(path), publish, **feed_kwargs), show_pid=False)


def one_trace_feed(workload: Workload, publish: Any) -> LiveFeed:
    """The feed of the demo's screen: the one trace a workload kvdoctor started writes."""
    return LiveFeed(str(workload.trace), publish, workload=workload, wait_s=60)


def workload_feed(workload: Workload, publish: Any) -> WorkloadFeed:
    """The feed of ``watch -- CMD``'s screen: every trace a workload kvdoctor started writes."""
    traces = TraceSet.of_child(workload, str(workload.trace.parent), name=workload.title, wait_s=60)
    return WorkloadFeed(WorkloadSession(traces, name_traces=True), publish, workload=workload)


def live_app(path: Path, **feed_kwargs: Any) -> KvdoctorApp:
    return KvdoctorApp(lambda publish: LiveFeed(str(path), publish, **feed_kwargs), show_pid=False)


async def wait_for(pilot: Any, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Let the app run until ``predicate()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")
        await pilot.pause(0.05)


async def wait_settled(pilot: Any, timeout: float = 20.0) -> None:
    """Until the feed waits for a command (or has finished) and the app shows its newest snapshot."""
    app = pilot.app
    await wait_for(pilot, lambda: app.feed is not None and app.feed.settled.is_set()
                   and app.snapshot is not None and app.snapshot.serial == app.feed.last_serial, timeout)
    await pilot.pause()


async def wait_ended(pilot: Any, timeout: float = 20.0) -> None:
    """Until the feed has read its whole source and the app shows that last snapshot."""
    await wait_settled(pilot, timeout)
    assert pilot.app.snapshot.ended is not None, pilot.app.snapshot.status


@contextlib.asynccontextmanager
async def replayed(path: Path, size: tuple[int, int] = (100, 30), **feed_kwargs: Any) -> AsyncIterator[tuple[KvdoctorApp, Any]]:
    """``(app, pilot)`` of a headless app that has replayed ``path`` to its end."""
    app = replay_app(path, **feed_kwargs)
    async with app.run_test(size=size) as pilot:
        await wait_ended(pilot)
        yield app, pilot


def screen_text(app: KvdoctorApp) -> str:
    """What the terminal shows, as plain text (for assertions on rendered content)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system="truecolor", legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def sync(test: Callable[..., Any]) -> Callable[..., Any]:
    """Run an async test function in its own event loop (no pytest asyncio plugin needed)."""
    import asyncio
    import functools

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(test(*args, **kwargs))

    return run
