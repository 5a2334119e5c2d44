"""A workload started by ``kvdoctor watch``: a child process that writes a trace we follow.

The child runs with ``KVDOCTOR_TRACE`` pointing at a fresh file (and ``KVDOCTOR_FAULT``
when asked), so any script that builds kvdoctor's engine is traced without changes.
Its output goes to a log file rather than the terminal, which belongs to the TUI; when
it exits or crashes, the last lines of that log explain why. A reaper thread waits for
the child, so its pid disappears the moment it exits and the trace follower notices.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import UsageError

__all__ = ["Workload"]

_TAIL_BYTES = 4000


class Workload:
    """A child process with tracing switched on; ``trace`` is the file it writes."""

    def __init__(self, argv: list[str], *, fault: str | None = None, probes: bool = True,
                 workdir: str | None = None, title: str | None = None) -> None:
        if not argv:
            raise UsageError("no workload command given: use `kvdoctor watch -- python my_script.py`")
        self.argv = argv
        self.title = title or shlex.join(argv)  # what the screen calls it while it starts
        self._dir = Path(workdir or tempfile.mkdtemp(prefix="kvdoctor-watch-"))
        self.trace = self._dir / "workload.kvtrace"
        self.log = self._dir / "workload.log"
        env = dict(os.environ, KVDOCTOR_TRACE=str(self.trace), PYTHONUNBUFFERED="1")
        if fault:
            env["KVDOCTOR_FAULT"] = fault
        if probes:  # memory readings (mem events) from the engine's probe hook, unless the user chose
            env.setdefault("KVDOCTOR_PROBES", "1")
        self._log_file = open(self.log, "wb")
        try:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the TUI must not reach the workload first
            )
        except FileNotFoundError:
            raise UsageError(f"cannot start the workload: no such program {argv[0]!r}") from None
        except PermissionError:
            raise UsageError(f"cannot start the workload: {argv[0]!r} is not executable") from None
        self.returncode: int | None = None
        self.stopped = False  # we asked it to stop (quit), so a signal death is no crash
        self._reaper = threading.Thread(target=self._reap, name="kvdoctor-reaper", daemon=True)
        self._reaper.start()

    @classmethod
    def demo(cls, *, fault: str | None = None, model: str | None = None, seconds: float | None = None,
             workdir: str | None = None) -> "Workload":
        """The embedded demo (``python -m kvdoctor.demo``) in a child process; it attaches its own probes."""
        argv = [sys.executable, "-m", "kvdoctor.demo"]
        if model:
            argv += ["--model", model]
        if seconds is not None:
            argv += ["--seconds", str(seconds)]
        what = "a tiny random model" if model == "tiny" else model or "SmolLM2-135M (the first run converts it, ~20 s)"
        return cls(argv, fault=fault, probes=False, workdir=workdir, title=f"the demo: {what} serving chat requests")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int | None:
        """The exit status once the workload is gone (None if it is still running after ``timeout`` s)."""
        self._reaper.join(timeout)
        return self.returncode

    def _reap(self) -> None:
        self.returncode = self.proc.wait()
        self._log_file.close()

    def exit_message(self) -> str:
        """Why the workload is gone, in one line a user can act on."""
        code = self.returncode
        if code is None:
            return "workload still running"
        if code == 0:
            return "workload finished (exit 0)"
        if code < 0 and self.stopped:
            return "workload stopped on quit"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"workload killed by {name}"
        last = self.log_tail().strip().splitlines()
        return f"workload crashed (exit {code})" + (f": {last[-1]}" if last else "")

    def log_tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - _TAIL_BYTES, 0))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 3.0) -> None:
        """Ask the workload to stop (SIGINT, then SIGTERM, then SIGKILL); returns when it is gone."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not self._reaper.is_alive():
                break
            self.stopped = True
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            self._reaper.join(timeout)
