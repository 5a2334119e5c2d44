"""`kvdoctor replay` and `kvdoctor watch` in a real terminal: tmux send-keys and capture-pane.

Skipped where tmux is not installed. Each test starts its own tmux server (``-L``), so it
never touches a user's sessions.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Tmux:
    def __init__(self, command: list[str], cwd: Path, width: int = 100, height: int = 30) -> None:
        self.server = f"kvdoctor-test-{uuid.uuid4().hex[:8]}"
        self.cwd = cwd
        self._tmux("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
                   f"{shlex.join(command)}; echo \"exit status $?\"; sleep 30")

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.server, *args], cwd=self.cwd, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, f"tmux {' '.join(args)}: {done.stderr}"
        return done.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-t", "t")  # -J: wrapped lines joined

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if text in screen:
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never appeared; the screen shows:\n{screen}")
            time.sleep(0.2)

    def wait_gone(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while text in self.screen():
            assert time.monotonic() < deadline, f"{text!r} is still on screen"
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def tmux_factory(tmp_path: Path):
    sessions: list[Tmux] = []

    def start(*args: str) -> Tmux:
        t = Tmux([sys.executable, "-m", "kvdoctor.cli", *args], cwd=tmp_path)
        sessions.append(t)
        return t

    yield start
    for t in sessions:
        t.close()


def test_replay_in_tmux_navigates_and_quits(tmux_factory, leak_trace: Path):
    t = tmux_factory("replay", str(leak_trace), "--speed", "0")
    # THEN the overview shows the end of the trace, the gauges and the leak findings
    screen = t.wait_for("end of trace")
    assert "host" in screen and "leak/unreachable-swapped" in screen and "errors" in screen
    # WHEN the findings screen is opened and a block searched
    t.keys("2")
    assert "evidence" in t.wait_for("detail")
    t.keys("s")
    t.wait_for("search:")
    t.keys("b3", "Enter")
    assert "block 3 " in t.wait_for("owners:")  # the block's detail view
    t.keys("Escape")
    t.wait_gone("owners:")  # escape alone (a key right after it would read as alt+key)
    # WHEN q is pressed THEN the program ends with status 0 (the shell's sleep keeps the pane)
    t.keys("q")
    assert "exit status 0" in t.wait_for("exit status", timeout=20)


def test_watch_missing_trace_is_one_line_with_exit_code_3(tmux_factory, tmp_path: Path):
    bad = tmp_path / "not-a-trace.kvtrace"
    bad.write_text("hello\n")
    t = tmux_factory("watch", "--trace", str(bad))
    screen = t.wait_for("exit status")
    assert "is not a kvdoctor trace" in screen and "exit status 3" in screen and "Traceback" not in screen
