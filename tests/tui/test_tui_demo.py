"""The real demo under the TUI: `kvdoctor watch --demo --fault leak-swapped` shows the leak live.

Runs headless (Textual's Pilot) with the demo workload in a child process, as the command
does. The tiny random model keeps it quick; the embedded SmolLM2 variant is marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor.tui.app import KvdoctorApp
from kvdoctor.tui.feed import LiveFeed
from kvdoctor.tui.workload import Workload
from tui_helpers import screen_text, sync, wait_for


async def _watch_demo_until_leak(model: str | None, timeout: float, workdir: Path) -> None:
    workload = Workload.demo(fault="leak-swapped", model=model, seconds=timeout, workdir=str(workdir))
    app = KvdoctorApp(lambda publish: LiveFeed(str(workload.trace), publish, workload=workload, wait_s=timeout),
                      workload=workload, show_pid=False)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            # THEN the leak of a swapped-out block is found while the workload runs
            await wait_for(pilot, lambda: app.snapshot is not None and any(
                f.check == "leak" and f.rule == "unreachable-swapped" for f in app.snapshot.findings), timeout)
            assert app.snapshot.ended is None, "found live, not after the workload ended"
            await pilot.pause(0.2)
            text = screen_text(app)
            assert "leak/unreachable-swapped" in text and "host" in text
            host = next(t for t in app.snapshot.tiers if t.name == "host")
            assert host.leaked >= 1
            # AND the finding carries the workload's Python stacks (py-spy), or why there are none
            leak = next(f for f in app.snapshot.findings if f.check == "leak")
            assert "stacks" in leak.attribution or "stacks_error" in leak.attribution
            await pilot.press("q")
    finally:
        workload.stop()
    # AND quitting stopped the workload, which is not reported as a crash
    assert workload.returncode is not None
    assert workload.exit_message() in ("workload stopped on quit", "workload finished (exit 0)")


@sync
async def test_watch_demo_tiny_model_shows_leak_swapped_live(tmp_path: Path):
    await _watch_demo_until_leak("tiny", timeout=240, workdir=tmp_path)


@pytest.mark.slow
@sync
async def test_watch_demo_smollm2_shows_leak_swapped_live(tmp_path: Path):
    await _watch_demo_until_leak(None, timeout=600, workdir=tmp_path)
