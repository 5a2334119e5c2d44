"""A workload started by ``kvdoctor watch``: a traced child process whose output goes to a log file.

The terminal belongs to the TUI, so the child's output goes to a log file instead; when
it exits or crashes, the last line of that log says why. The child runs in a session
of its own (see ``kvdoctor.child``), so a Ctrl-C in the TUI reaches the TUI first and the
workload only when the TUI asks it to stop, and it never outlives the TUI.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from ..child import TracedChild
from ..errors import UsageError

__all__ = ["Workload"]

_TAIL_BYTES = 4000


class Workload(TracedChild):
    """A child process with tracing switched on; ``trace`` is the file it writes, ``log`` its output."""

    def __init__(self, argv: list[str], *, fault: str | None = None, probes: bool = True,
                 workdir: str | None = None, title: str | None = None) -> None:
        if not argv:
            raise UsageError("no workload command given: use `kvdoctor watch -- python my_script.py`")
        self.title = title or shlex.join(argv)  # what the screen calls it while it starts
        self._dir = Path(workdir or tempfile.mkdtemp(prefix="kvdoctor-watch-"))
        self._own_dir = workdir is None  # a directory we made is ours to remove (``remove``)
        self.trace = self._dir / "workload.kvtrace"
        self.log = self._dir / "workload.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if probes:  # memory readings (mem events) from the engine's probe hook, unless the user chose
            env.setdefault("KVDOCTOR_PROBES", "1")
        self._log_file = open(self.log, "wb")
        try:
            super().__init__(argv, str(self.trace), fault=fault, env=env, stdout=self._log_file,
                             on_exit=self._log_file.close)
        except UsageError:
            self._log_file.close()
            raise

    @classmethod
    def demo(cls, *, fault: str | None = None, model: str | None = None, seconds: float | None = None,
             workdir: str | None = None, codec: str | None = None, prefix_cache: bool = False,
             options: Sequence[str] = ()) -> "Workload":
        """The embedded demo (``python -m kvdoctor.demo``) in a child process; it attaches its own probes.
        ``options`` are more of the demo's options: those ``fault`` needs to fire."""
        argv = [sys.executable, "-m", "kvdoctor.demo", "--answers"]  # for the Output screen
        if model:
            argv += ["--model", model]
        if seconds is not None:
            argv += ["--seconds", str(seconds)]
        if codec:
            argv += ["--codec", codec]
        argv += list(options)  # a fault's needs (``kvdoctor.demo.fault_options``)
        if prefix_cache and "--prefix-cache" not in argv:
            argv += ["--prefix-cache"]
        what = "a tiny random model" if model == "tiny" else model or "SmolLM2-135M (the first run converts it, ~20 s)"
        return cls(argv, fault=fault, probes=False, workdir=workdir, title=f"the demo: {what} serving chat requests")

    def exit_message(self, last_line: str = "") -> str:
        """Why the workload is gone; a crash quotes the last line of its log."""
        if not last_line and self.returncode is not None and self.returncode > 0:
            lines = self.log_tail().strip().splitlines()
            last_line = lines[-1] if lines else ""
        return super().exit_message(last_line)

    def remove(self) -> None:
        """Delete the directory kvdoctor made for the trace and log (about 1 MB a minute of the demo), once
        the workload is stopped; a ``workdir`` the caller gave stays."""
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def log_tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - _TAIL_BYTES, 0))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""
