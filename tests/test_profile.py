"""``kvdoctor profile -- CMD``: a flame graph or speedscope profile of a workload."""

import json
import sys

import pytest

from kvdoctor.cli import main
from kvdoctor.probes.pyspy import ptrace_status

WORKLOAD = """
import time
def busy_decode():
    t = time.time()
    while time.time() - t < {seconds}:
        sum(range(2000))
busy_decode()
"""

pytestmark = pytest.mark.skipif(not ptrace_status()["may_attach_child"], reason="ptrace of a child is not permitted here")


def _workload(tmp_path, seconds: float) -> list[str]:
    script = tmp_path / "work.py"
    script.write_text(WORKLOAD.format(seconds=seconds))
    return [sys.executable, str(script)]


def test_flame_graph_of_a_workload_for_n_seconds(tmp_path, capsys):
    # GIVEN a workload busy for 30 s WHEN profiled for 1 s
    out = tmp_path / "p.svg"
    code = main(["profile", "-d", "1", "-o", str(out), "--", *_workload(tmp_path, 30)])
    # THEN an SVG flame graph names its hot function, and profiling stopped after the duration
    assert code == 0
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "busy_decode" in svg
    assert f"wrote {out}" in capsys.readouterr().err


def test_speedscope_profile_until_the_workload_exits(tmp_path):
    out = tmp_path / "p.json"
    assert main(["profile", "-f", "speedscope", "-o", str(out), "--", *_workload(tmp_path, 1)]) == 0
    profile = json.loads(out.read_text())
    assert "busy_decode" in {frame["name"] for frame in profile["shared"]["frames"]}


def test_a_workload_py_spy_cannot_profile_is_a_one_line_error(tmp_path, capsys):
    # GIVEN a workload that is not Python WHEN profiled THEN py-spy's reason is the last line, and no file
    code = main(["profile", "-o", str(tmp_path / "x.svg"), "--", "sleep", "3"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvdoctor profile: no profile written: Error: Failed to find python version")
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.parametrize("argv,message", [
    (["profile"], "nothing to profile: give a workload after `--`"),
    (["profile", "--pid", "1", "--", "python"], "not both"),
    (["profile", "--pid", "0"], "--pid must be a process id"),
    (["profile", "-d", "0", "--", "python"], "--duration must be > 0"),
    (["profile", "-r", "0", "--", "python"], "--rate must be"),
])
def test_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
