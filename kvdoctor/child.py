"""A workload in a child process with tracing switched on: what `kvdoctor check -- CMD` and
`kvdoctor watch -- CMD` both start.

The child runs with ``KVDOCTOR_TRACE`` pointing at the trace to follow (and
``KVDOCTOR_FAULT`` when asked), so any script that builds kvdoctor's engine is
traced without changes. A reaper thread waits for it, so its pid disappears the
moment it exits and a trace follower watching that pid notices.

A workload never outlives kvdoctor. It runs in a process group of its own (so a Ctrl-C
meant for kvdoctor reaches kvdoctor first, and stopping it stops whatever it started
too), and a guard watches kvdoctor for it: a tiny ``sh`` in a session of its own that
holds the read end of a pipe only kvdoctor writes to. However kvdoctor ends — a clean
quit, SIGHUP from a closed terminal, SIGTERM, a crash, SIGKILL — the kernel closes the
write end; unless kvdoctor said ``released`` first, the guard sends the group SIGTERM
and, if anything is left after 3 s, SIGKILL. Unlike the parent-death signal
(``PR_SET_PDEATHSIG``) this reaches the workload's own children as well and needs no
``preexec_fn`` in a threaded parent. A workload's trace is flushed at every step, so the
cut leaves it closed (the demo closes it on SIGTERM) or cleanly truncated.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import IO, Callable

from .errors import UsageError

__all__ = ["TracedChild"]


class TracedChild:
    """``argv`` started with its trace at ``trace``; ``returncode`` is set once it exited.

    ``stdout`` takes the child's output and error streams together (a descriptor or file;
    None: both inherit ours); ``on_exit`` runs on the reaper thread.
    """

    def __init__(self, argv: list[str], trace: str, *, fault: str | None = None, env: dict[str, str] | None = None,
                 stdout: int | IO[bytes] | None = None, on_exit: Callable[[], None] | None = None) -> None:
        self.argv = list(argv)
        child_env = dict(os.environ if env is None else env, KVDOCTOR_TRACE=trace)
        if fault:
            child_env["KVDOCTOR_FAULT"] = fault
        try:
            self.proc = subprocess.Popen(argv, env=child_env, stdin=subprocess.DEVNULL, stdout=stdout,
                                         stderr=None if stdout is None else subprocess.STDOUT,
                                         start_new_session=True)
        except FileNotFoundError:
            raise UsageError(f"cannot start the workload: no such program {argv[0]!r}") from None
        except PermissionError:
            raise UsageError(f"cannot start the workload: {argv[0]!r} is not executable") from None
        self.returncode: int | None = None
        self.stopped = False  # we asked it to stop, so a death by signal is no crash
        self._guard = _Guard(self.proc.pid)
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

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the child's process group (SIGINT, then SIGTERM, then SIGKILL, ``timeout`` s apart: gone
        within 5 s even if it ignores the first two); returns when it is gone, and releases the guard."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not _group_alive(self.proc.pid):
                break
            if self._reaper.is_alive():
                self.stopped = True  # only the workload's own leftovers otherwise: its exit status stands
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):  # gone, or only members we may not signal are left
                break
            deadline = time.monotonic() + timeout
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                self._reaper.join(_POLL_S)
        self._guard.release()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user: still there
        return True
    return True


_POLL_S = 0.05
# The guard's script: $1 is the workload's process group. The read returns once kvdoctor wrote
# "released" (the group is already stopped) or its end of the pipe closed with it (kvdoctor is gone).
_GUARD_SCRIPT = """trap '' HUP INT TERM
read -r word
[ "$word" = released ] && exit 0
kill -s TERM -- "-$1" 2>/dev/null || exit 0
i=0
while [ $i -lt 30 ] && kill -s 0 -- "-$1" 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
kill -s KILL -- "-$1" 2>/dev/null
exit 0
"""


class _Guard:
    """The process that stops the group ``pgid`` once kvdoctor is gone (see the module docstring)."""

    def __init__(self, pgid: int) -> None:
        read_end, self._write_end = os.pipe()  # both non-inheritable: later children do not hold the pipe open
        try:
            self.proc = subprocess.Popen(["/bin/sh", "-c", _GUARD_SCRIPT, "kvdoctor-guard", str(pgid)],
                                         stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)  # a closed terminal's SIGHUP must not reach it
        finally:
            os.close(read_end)
        self._lock = threading.Lock()

    def release(self) -> None:
        """The group is stopped: let the guard exit without signalling (safe to call twice)."""
        with self._lock:
            if self._write_end < 0:
                return
            fd, self._write_end = self._write_end, -1
        try:
            os.write(fd, b"released\n")
        except OSError:
            pass  # the guard is gone already
        os.close(fd)
        self.proc.wait()
