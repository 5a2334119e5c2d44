"""The TUI over a workload of several traces: a selector of trace, per-trace views, one merged findings list.

Two synthetic traces in one folder, as two instances of a deployment write them: instance ``a`` clean,
instance ``b`` (a decode instance) leaking swapped-out blocks. The real app runs headless over the folder
(``kvdoctor watch --trace DIR``'s feed) and is driven with keys.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvdoctor.child import TracedChild
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.app import KvdoctorApp, workload_app
from kvdoctor.tui.synthetic import SyntheticWorkload
from kvdoctor.tui.traces import WorkloadFeed
from kvdoctor.tui.widgets.findings import FindingsList
from kvdoctor.tui.workload import Workload
from kvdoctor.workload import TraceSet, WorkloadSession

from tui_helpers import screen_text, sync, wait_ended, wait_for


def _write(path: Path, fault: str | None, **who) -> None:
    w = SyntheticWorkload(num_steps=150, fault=fault)
    with TraceWriter(path, msgspec.structs.replace(w.header(), **who)) as writer:
        writer.write_many(list(w.events()))


@pytest.fixture(scope="module")
def workload_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("workload")
    _write(folder / "run.kvtrace", None, instance="a")
    _write(folder / "run.2.kvtrace", "leak-swapped", instance="b", role="decode")
    return folder


def folder_app(folder: Path) -> KvdoctorApp:
    session = WorkloadSession(TraceSet.open([str(folder)]), name_traces=True)
    return KvdoctorApp(lambda publish: WorkloadFeed(session, publish), show_pid=False)


def _leaked(app: KvdoctorApp) -> int:
    return sum(t.leaked for t in app.snapshot.tiers)


@sync
async def test_t_switches_the_trace_shown_and_findings_stay_merged(workload_dir):
    app = folder_app(workload_dir)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_ended(pilot)
        s = app.snapshot
        # GIVEN both traces read: the selector names them, the first (clean) one is shown
        assert [v.label for v in s.traces] == ["instance a", "instance b (decode)"] and s.shown == 0
        assert s.header.instance == "a" and _leaked(app) == 0
        assert "trace 1/2" in screen_text(app) and "instance b (decode)" in screen_text(app)
        # AND the findings list (screen 2) holds instance b's findings, each line naming its trace
        assert s.findings and {f.trace.rsplit("/", 1)[1] for f in s.findings} == {"run.2.kvtrace"}
        await pilot.press("2")
        flist = app.query_one("#findings-list", FindingsList)
        assert "[instance b (decode)]" in flist.row_text(0, 200).plain
        # WHEN t is pressed THEN instance b's state is shown: its header, its leaked blocks in the map
        await pilot.press("t")
        await wait_for(pilot, lambda: app.snapshot.shown == 1)
        assert app.snapshot.header.instance == "b" and _leaked(app) > 0
        assert app.snapshot.findings == s.findings
        # WHEN T is pressed THEN back to the first
        await pilot.press("T")
        await wait_for(pilot, lambda: app.snapshot.shown == 0)
        assert app.snapshot.header.instance == "a"


@sync
async def test_one_trace_shows_no_selector(clean_trace):
    app = folder_app(clean_trace.parent)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_ended(pilot)
        assert len(app.snapshot.traces) == 1 and "trace 1/" not in screen_text(app)
        assert not app.check_action("trace", (1,))


def test_workload_of_two_traces_at_80x24(snap_compare, workload_dir):
    async def second_trace_shown(pilot) -> None:
        await wait_ended(pilot)
        await pilot.press("t")
        await wait_for(pilot, lambda: pilot.app.snapshot.shown == 1)
        await pilot.pause()

    assert snap_compare(folder_app(workload_dir), terminal_size=(80, 24), run_before=second_trace_shown)


# ---- traces that appear while the screen is open --------------------------------------------

TWO_ENGINES = '''
import sys, tempfile, time
import torch
from kvdoctor.engine import EngineConfig, PagedKVCache

def engine(fault=None):
    return PagedKVCache(EngineConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                                     device_blocks=4, host_blocks=4, disk_blocks=8, chunk_blocks=2,
                                     disk_dir=tempfile.mkdtemp(), fault=fault))

def serve(cache, seq):
    cache.add_sequence(seq, prompt_len=8)
    slots = cache.reserve(seq, 8)
    for layer in range(2):
        cache.store(layer, slots, torch.randn(8, 2, 8), torch.randn(8, 2, 8))
    cache.commit(seq, 8)
    cache.end_step()
    away, home = cache.block_table(seq)
    cache.swap_out([away], "host")
    cache.remove_sequence(seq)
    cache.end_step()

first = engine()
serve(first, "a")
time.sleep(float(sys.argv[1]))  # the second engine comes later, while the first is still open
second = engine("leak-swapped")  # it strands a swapped-out block
serve(second, "b")
second.close()
serve(first, "c")
first.close()
'''


def _two_engines(tmp_path: Path) -> list[str]:
    script = tmp_path / "two_engines.py"
    script.write_text(TWO_ENGINES)
    return [sys.executable, str(script), "2"]


async def _second_engine_found(pilot, app: KvdoctorApp, second: str) -> None:
    """The screen took in the second engine's trace as it appeared: the selector names both, the leak of the
    second is in the merged list naming its trace, and t shows the second engine's map with the leaked block."""
    await wait_ended(pilot, timeout=180)
    s = app.snapshot
    assert [v.name.rsplit("/", 1)[-1] for v in s.traces] == ["run.kvtrace" if second == "run.2.kvtrace" else
                                                             "workload.kvtrace", second] and s.shown == 0
    assert "trace 1/2" in screen_text(app) and _leaked(app) == 0
    assert {f.rule for f in s.findings} == {"unreachable-swapped"}
    assert {f.trace.rsplit("/", 1)[-1] for f in s.findings} == {second}
    await pilot.press("t")
    await wait_for(pilot, lambda: app.snapshot.shown == 1)
    assert _leaked(app) > 0


@sync
async def test_watch_of_a_command_takes_in_every_trace_it_writes(tmp_path):
    # GIVEN `watch -- CMD` of a process that builds a second engine (leaking) a moment after its first
    workload = Workload(_two_engines(tmp_path), workdir=str(tmp_path))
    app = workload_app(TraceSet.of_child(workload, str(workload.trace.parent), name=workload.title, wait_s=120),
                       workload=workload)
    try:
        async with app.run_test(size=(110, 30)) as pilot:
            # THEN both engines' traces are on the screen, with the selector, the leak found in the second
            await _second_engine_found(pilot, app, "workload.2.kvtrace")
            # AND the screen ends with how the workload exited
            assert app.snapshot.ended == "workload finished (exit 0)", app.snapshot.ended
    finally:
        workload.stop()


@sync
async def test_watch_of_a_directory_takes_in_a_trace_that_appears_after_it_opens(tmp_path):
    # GIVEN a process writing run.kvtrace into a directory, whose second engine writes run.2.kvtrace later
    folder = tmp_path / "traces"
    folder.mkdir()
    writer = TracedChild(_two_engines(tmp_path), str(folder / "run.kvtrace"))
    try:
        deadline = time.monotonic() + 120
        while not list(folder.glob("run.kvtrace")) or (folder / "run.kvtrace").stat().st_size == 0:
            assert time.monotonic() < deadline and writer.returncode is None, "the first engine wrote no trace"
            time.sleep(0.1)
        assert not (folder / "run.2.kvtrace").exists()
        # WHEN `watch --trace DIR` opens on the directory with only the first trace in it
        traces = TraceSet.open([str(folder)], alive=lambda: traces.writers_alive())
        app = workload_app(traces)
        async with app.run_test(size=(110, 30)) as pilot:
            # THEN the second trace joins the screen as it appears
            await _second_engine_found(pilot, app, "run.2.kvtrace")
    finally:
        writer.stop()
