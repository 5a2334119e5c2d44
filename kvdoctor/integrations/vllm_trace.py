"""What every trace the plugin writes inside vLLM's processes shares: events buffered a step at a time.

The engine core's scheduler (``vllm.VllmTracer``) and each tensor- or pipeline-parallel rank
(``vllm_ranks.RankTrace``) record on vLLM's own thread. Events go to a buffer and reach the file when a
step ends (a killed process loses at most its last step); a failure of kvdoctor's bookkeeping is the
trace's last event, and closing, at exit too, never raises into vLLM.
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any

import msgspec

from ..events import ObserverError
from ..trace import TraceWriter

__all__ = ["BufferedTrace", "warn"]


def warn(message: str) -> None:
    """One line for the person running vLLM, never a traceback from inside vLLM."""
    try:
        sys.stderr.write(f"kvdoctor: {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


class BufferedTrace:
    """A trace's buffer and writer; a subclass opens ``writer`` and emits. ``step`` counts the steps written."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter_ns()
        self.step = 0
        self._buf: list = []
        self.writer: TraceWriter | None = None

    def _open(self, path: str, header: Any) -> None:
        self.writer = TraceWriter(path, header)
        atexit.register(self.close)

    def _emit(self, cls: type, **fields: Any) -> None:
        self._buf.append(cls(t=time.perf_counter_ns() - self._t0, step=self.step, **fields))

    def _record_error(self, event: ObserverError) -> None:
        """The guard's record: the error is the trace's last event."""
        self._buf.append(msgspec.structs.replace(event, t=time.perf_counter_ns() - self._t0, step=self.step))
        self.close()

    def _write_step(self) -> None:
        """The step's events to the file; the next step begins."""
        self.writer.write_many(self._buf)
        self._buf = []
        self.step += 1

    def close(self) -> None:
        """Write what is buffered and close the trace; at exit too, so it must not raise."""
        try:
            atexit.unregister(self.close)
            if self.writer is not None and not self.writer.closed:
                self.writer.write_many(self._buf)
                self._buf = []
                self.writer.close()
        except Exception as exc:
            warn(f"the trace could not be closed ({type(exc).__name__}: {exc})")
