"""A running process as a workload: ``kvdoctor check|watch --pid PID``.

Its kvdoctor caches are asked (``kvdoctor.attach``) to trace into a folder of our own; every trace they
write there is read as it grows, like a workload we started; closing takes the request back, so the
process stops tracing, and removes the folder.
"""

from __future__ import annotations

import os
import sys
import tempfile
import _thread
import threading

from .attach import Attachment
from .workload import TraceSet

__all__ = ["ProcessTraces"]

_GRACE_S = 5.0  # after detaching: how long the process's caches get to close their traces at a step's end


class ProcessTraces(TraceSet):
    """The traces process ``pid``'s caches write from the moment they attach until ``detach``."""

    def __init__(self, pid: int, *, wait_s: float) -> None:
        tmp = tempfile.TemporaryDirectory(prefix="kvdoctor-pid-")
        try:
            self.attachment = Attachment(pid, os.path.join(tmp.name, "run.kvtrace"))
        except BaseException:
            tmp.cleanup()
            raise
        super().__init__(f"process {pid}", watch=tmp.name, wait_s=wait_s, alive=self._attached)
        self._tmp, self.follow = tmp, True
        self.pid = pid
        self._closed = threading.Event()

    def attach(self, timeout: float) -> list[dict]:
        """Ask, and wait for the first cache to answer; say on stderr what it held."""
        self.attachment.start()
        try:
            answers = self.attachment.wait(timeout)
        except BaseException:
            self.close()
            raise
        first = answers[0]
        print(f"kvdoctor: attached to process {self.pid} at its step {first['step']}: its cache holds "
              f"{first['blocks']} blocks of {first['seqs']} sequences (a snapshot starts the trace)", file=sys.stderr)
        return answers

    def _attached(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return self.attachment.active

    def detach_after(self, seconds: float) -> None:
        """Take the request back after ``seconds``; the checks then end with the traces, or, when the process's
        engine runs no step to close them, ``_GRACE_S`` later as if interrupted (what was read is reported)."""

        def stop() -> None:
            if self._closed.wait(seconds):
                return
            self.attachment.close()
            if not self._closed.wait(_GRACE_S):
                _thread.interrupt_main()

        threading.Thread(target=stop, name="kvdoctor-detach", daemon=True).start()

    def label(self, path: str) -> str:
        return os.path.basename(path)  # its folder goes when the check ends

    def close(self) -> None:
        self._closed.set()
        self.attachment.close()
        super().close()
