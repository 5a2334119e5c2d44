"""The TUI over a workload of several traces: a selector of trace, per-trace views, one merged findings list.

Two synthetic traces in one folder, as two instances of a deployment write them: instance ``a`` clean,
instance ``b`` (a decode instance) leaking swapped-out blocks. The real app runs headless over the folder
(``kvdoctor watch --trace DIR``'s feed) and is driven with keys.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvdoctor.trace import TraceWriter
from kvdoctor.tui.app import KvdoctorApp
from kvdoctor.tui.synthetic import SyntheticWorkload
from kvdoctor.tui.traces import WorkloadFeed
from kvdoctor.tui.widgets.findings import FindingsList
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


def workload_app(folder: Path) -> KvdoctorApp:
    session = WorkloadSession(TraceSet.open([str(folder)]), name_traces=True)
    return KvdoctorApp(lambda publish: WorkloadFeed(session, publish), show_pid=False)


def _leaked(app: KvdoctorApp) -> int:
    return sum(t.leaked for t in app.snapshot.tiers)


@sync
async def test_t_switches_the_trace_shown_and_findings_stay_merged(workload_dir):
    app = workload_app(workload_dir)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_ended(pilot)
        s = app.snapshot
        # GIVEN both traces read: the selector names them, the first (clean) one is shown
        assert [v.label for v in s.traces] == ["instance a", "instance b (decode)"] and s.shown == 0
        assert s.header.instance == "a" and _leaked(app) == 0
        assert "trace 1/2" in screen_text(app) and "instance b (decode)" in screen_text(app)
        # AND the findings list holds instance b's findings, each line naming its trace
        assert s.findings and {f.trace.rsplit("/", 1)[1] for f in s.findings} == {"run.2.kvtrace"}
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
    app = workload_app(clean_trace.parent)
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

    assert snap_compare(workload_app(workload_dir), terminal_size=(80, 24), run_before=second_trace_shown)
