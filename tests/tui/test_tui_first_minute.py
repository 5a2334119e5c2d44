"""The first minute of `kvdoctor watch`: what a newcomer sees while the workload loads its model and runs its
first step, the workload's own output, and findings read in full from the overview (issue 33, item 7)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from kvdoctor.cli import main
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.app import KvdoctorApp
from kvdoctor.tui.synthetic import SyntheticWorkload
from kvdoctor.tui.widgets.findings import RecentFindings
from kvdoctor.tui.workload import Workload
from tui_helpers import (live_app, one_trace_feed, replayed, screen_text, sync, wait_ended, wait_for,
                         workload_feed)


@sync
async def test_the_header_says_the_model_loads_until_the_first_step_ends(tmp_path: Path):
    # GIVEN the TUI following a trace its workload has not written yet (a model still loading)
    path = tmp_path / "workload.kvtrace"
    w = SyntheticWorkload(num_steps=5)
    events = list(w.events())
    app = live_app(path, wait_s=30)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None)
        # THEN no step and no rate of 0 tok/s: the model is loading
        assert "loading model…" in screen_text(app) and "tok/s" not in screen_text(app)
        # WHEN the header is written (the model is loaded) THEN the first step is running
        writer = TraceWriter(path, w.header())
        await wait_for(pilot, lambda: app.snapshot.header is not None)
        assert "running the first step…" in screen_text(app) and "tok/s" not in screen_text(app)
        # WHEN the first step ends THEN the step and the rates replace it
        first = next(i for i, ev in enumerate(events) if type(ev).__name__ == "StepEnd")
        writer.write_many(events[:first + 1])
        await wait_for(pilot, lambda: app.snapshot.steps_done == 1)
        await pilot.pause()
        assert "tok/s" in screen_text(app) and "first step" not in screen_text(app)
        writer.close()


@sync
async def test_the_overview_shows_each_newest_finding_whole_not_cut_at_the_pane_edge(leak_trace: Path):
    # GIVEN the smallest screen, its findings pane a third of the width, after a replay that found leaks
    async with replayed(leak_trace, size=(80, 24)) as (app, pilot):
        newest = app.snapshot.findings[-1]
        assert len(newest.message) > 40  # longer than the pane is wide
        # THEN the pane holds the newest message in full, wrapped: its last words are on screen
        pane = app.query_one(RecentFindings)
        assert newest.message in str(pane.render())
        assert " ".join(newest.message.split()[-4:]) in screen_text(app)  # "the end of step 283"


ANSWERING = """
import os
from kvdoctor.cli import main
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.synthetic import SyntheticWorkload
w = SyntheticWorkload(num_steps=20)
with TraceWriter(os.environ["KVDOCTOR_TRACE"], w.header()) as writer:
    writer.write_many(list(w.events()))
    print("[3] (stop) Paged attention stores the KV cache in fixed-size blocks.", flush=True)
"""


@pytest.mark.parametrize("feed", [one_trace_feed, workload_feed], ids=["the demo's screen", "watch -- CMD's screen"])
@sync
async def test_the_output_screen_shows_what_the_workload_printed(tmp_path: Path, feed):
    # GIVEN a workload kvdoctor started that prints an answer as it serves (as the demo does)
    workload = Workload([sys.executable, "-c", ANSWERING], workdir=str(tmp_path))
    app = KvdoctorApp(lambda publish: feed(workload, publish), workload=workload, show_pid=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ended(pilot)
        # WHEN the Output screen is opened THEN the answer is on it
        await pilot.press("6")
        await pilot.pause()
        assert "Paged attention stores the KV cache in fixed-size blocks." in screen_text(app)


@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep-trace"])
def test_watch_leaves_no_directory_in_the_temp_folder_unless_asked(tmp_path: Path, monkeypatch, capsys, keep):
    # GIVEN watch over a workload, its screen replaced by waiting for the workload to end
    from kvdoctor.commands import watch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(watch, "_watch_command", lambda workload, args, config, metrics: workload.wait(60))
    argv = ["watch", *(["--keep-trace"] if keep else []), "--", sys.executable, "-c", ANSWERING]
    # WHEN it runs and ends
    assert main(argv) == 0
    err = capsys.readouterr().err
    left = list(tmp_path.glob("kvdoctor-watch-*"))
    # THEN by default its directory is gone and the last line says how to keep it; with --keep-trace it stays
    if keep:
        assert len(left) == 1 and (left[0] / "workload.kvtrace").is_file() and "its traces:" in err
    else:
        assert left == [] and "--keep-trace keeps its trace" in err
