"""A workload in a child process with tracing switched on: what `kvdoctor check -- CMD` and
`kvdoctor watch -- CMD` both start.

The child runs with ``KVDOCTOR_TRACE`` pointing at the trace to follow (and
``KVDOCTOR_FAULT`` when asked), so any script that builds kvdoctor's engine is
traced without changes. A reaper thread waits for it, so its pid disappears the
moment it exits and a trace follower watching that pid notices.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import IO, Callable

from .errors import UsageError

__all__ = ["TracedChild"]


class TracedChild:
    """``argv`` started with its trace at ``trace``; ``returncode`` is set once it exited.

    ``stdout`` takes the child's output and error streams together (a descriptor or file;
    None: both inherit ours); ``own_session`` puts it in a process group of its own, so a Ctrl-C
    meant for a TUI does not reach it first; ``on_exit`` runs on the reaper thread.
    """

    def __init__(self, argv: list[str], trace: str, *, fault: str | None = None, env: dict[str, str] | None = None,
                 stdout: int | IO[bytes] | None = None, own_session: bool = False,
                 on_exit: Callable[[], None] | None = None) -> None:
        self.argv = list(argv)
        child_env = dict(os.environ if env is None else env, KVDOCTOR_TRACE=trace)
        if fault:
            child_env["KVDOCTOR_FAULT"] = fault
        try:
            self.proc = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL, stdout=stdout,
                                         stderr=None if stdout is None else subprocess.STDOUT,
                                         start_new_session=own_session)
        except FileNotFoundError:
            raise UsageError(f"cannot start the workload: no such program {argv[0]!r}") from None
        except PermissionError:
            raise UsageError(f"cannot start the workload: {argv[0]!r} is not executable") from None
        self.returncode: int | None = None
        self.stopped = False  # we asked it to stop, so a death by signal is no crash
        self._own_session = own_session
        self._on_exit = on_exit
        self._reaper = threading.Thread(target=self._reap, name="kvdoctor-reaper", daemon=True)
        self._reaper.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _reap(self) -> None:
        self.returncode = self.proc.wait()
        if self._on_exit is not None:
            self._on_exit()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once the child is gone (None if it still runs after ``timeout`` s)."""
        self._reaper.join(timeout)
        return self.returncode

    def exit_message(self, last_line: str = "") -> str:
        """Why the workload is gone, in one line a user can act on (``last_line``: what it printed last)."""
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
        return f"workload crashed (exit {code})" + (f": {last_line}" if last_line else "")

    def stop(self, timeout: float = 3.0) -> None:
        """Ask the child to stop (SIGINT, then SIGTERM, then SIGKILL); returns when it is gone."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not self._reaper.is_alive():
                break
            self.stopped = True
            try:
                if self._own_session:
                    os.killpg(self.proc.pid, sig)  # its own children too
                else:
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            self._reaper.join(timeout)
