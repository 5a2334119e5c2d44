"""Export the TUI as an SVG over a recorded trace: ``python -m kvdoctor.tui.screenshot TRACE OUT.svg``.

Replays the trace to its end headless (no terminal needed), optionally presses keys (a
screen number, ``d`` for a detail view), and saves what the terminal would show. This is
how ``docs/screenshot.svg`` is made.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from .app import KvdoctorApp
from .feed import ReplayFeed

__all__ = ["save_screenshot"]


async def save_screenshot(trace: str, out: str, *, size: tuple[int, int] = (120, 36), keys: list[str] | None = None,
                          timeout: float = 120.0) -> None:
    app = KvdoctorApp(lambda publish: ReplayFeed(trace, publish, speed=0), show_pid=False)
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + timeout
        while not (app.feed is not None and app.feed.settled.is_set() and app.snapshot is not None
                   and app.snapshot.serial == app.feed.last_serial):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replay of {trace} did not finish within {timeout:g} s")
            await pilot.pause(0.05)
        await pilot.press(*(keys or []))
        await pilot.pause(0.3)
        app.save_screenshot(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--size", default="120x36", help="terminal WIDTHxHEIGHT (default 120x36)")
    p.add_argument("--keys", default="", help="comma-separated keys to press first, e.g. 2,down")
    a = p.parse_args()
    width, height = (int(x) for x in a.size.lower().split("x"))
    asyncio.run(save_screenshot(a.trace, a.out, size=(width, height), keys=[k for k in a.keys.split(",") if k]))


if __name__ == "__main__":
    main()
