"""`kvdoctor watch` and `kvdoctor replay` refuse bad input with one line and the documented exit code,
before any screen opens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor.cli import main


@pytest.mark.parametrize("argv, code, words", [
    (["watch"], 2, "choose exactly one source"),
    (["watch", "--demo", "--trace", "x.kvtrace"], 2, "choose exactly one source"),
    (["watch", "--demo", "--fault", "bogus"], 2, "unknown fault 'bogus'"),
    (["watch", "--trace", "x.kvtrace", "--fault", "leak-swapped"], 2, "--fault applies to a workload"),
    (["watch", "--model", "tiny", "--", "python", "x.py"], 2, "--model applies to --demo only"),
    (["watch", "--codec", "mixed", "--trace", "x.kvtrace"], 2, "--codec applies to --demo only"),
    (["replay", "missing.kvtrace"], 3, "no such trace file"),
    (["replay", "--speed", "-1", "missing.kvtrace"], 2, "--speed must be >= 0"),
    (["replay", "--step", "-3", "missing.kvtrace"], 2, "--step must be >= 0"),
    (["replay", "--config", "nope.toml", "missing.kvtrace"], 3, "no such trace file"),
])
def test_bad_input_is_one_line_and_an_exit_code(argv, code, words, capsys, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == code
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_file_that_is_not_a_trace_is_refused_by_both(tmp_path: Path, capsys):
    bad = tmp_path / "notes.kvtrace"
    bad.write_text("just some text\n")
    assert main(["replay", str(bad)]) == 3
    assert main(["watch", "--trace", str(bad)]) == 3
    assert capsys.readouterr().err.count("is not a kvdoctor trace") == 2


def test_watch_waits_for_a_trace_that_never_appears_then_exits_3_before_the_screen_opens(tmp_path: Path, capsys):
    # GIVEN a trace no writer creates, and a short --wait
    missing = tmp_path / "missing.kvtrace"
    # WHEN watched THEN it says it waits, then that the file never came, with exit 3 (docs/tui.md)
    assert main(["watch", "--trace", str(missing), "--wait", "0.2"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert err == [f"kvdoctor watch: waiting up to 0.2 s for {missing} to appear",
                   f"kvdoctor watch: no trace at {missing}: waited 0.2 s for the file"]


@pytest.mark.parametrize("argv", [["replay", "-"], ["watch", "--trace", "-"], ["watch", "--trace", "/dev/stdin"]])
def test_a_trace_on_standard_input_is_refused_by_the_screens_that_read_keys_there(argv, tmp_path: Path):
    # GIVEN standard input that carries a trace
    trace = tmp_path / "t.kvtrace"
    trace.write_text("x\n")
    with open(trace, "rb") as stdin:
        # WHEN a TUI is asked to read it
        done = subprocess.run([sys.executable, "-m", "kvdoctor.cli", *argv], stdin=stdin, capture_output=True,
                              text=True, timeout=60)
    # THEN one line, exit 2: the screen needs standard input for its keys
    assert done.returncode == 2
    assert "standard input is the screen's keyboard" in done.stderr and len(done.stderr.splitlines()) == 1
