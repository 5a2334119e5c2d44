"""Event emission for the engine: free when nobody listens, batched when someone does.

The engine only records. It hands events to sinks (callables taking a list of
events) in batches at step ends, so a trace writer or a live checker costs one
call per step instead of one per event, and inference never waits on a consumer
beyond that call.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..events import Event, StepEnd

__all__ = ["Bus", "Sink"]

Sink = Callable[[list[Event]], None]

_MAX_BUFFERED = 8192  # bounds memory when a step emits a very large number of events


class Bus:
    def __init__(self) -> None:
        self._sinks: list[Sink] = []
        self._buf: list[Event] = []
        self._t0 = time.perf_counter_ns()
        self._step_t0 = self._t0
        self.step = 0
        # Hot paths test this attribute before building an event, so an unobserved engine
        # pays one attribute read per potential event.
        self.enabled = False
        self._after_step: list[Callable[[], None]] = []

    def after_step(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` after each step is closed and handed to the sinks: the moment a cache is whole (a
        trace attached from outside starts there)."""
        self._after_step.append(hook)

    def subscribe(self, sink: Sink) -> None:
        self._sinks.append(sink)
        self.enabled = True

    def unsubscribe(self, sink: Sink) -> None:
        self.flush()
        self._sinks.remove(sink)
        self.enabled = bool(self._sinks)

    def now(self) -> int:
        """Nanoseconds since the bus was created: the ``t`` of every event."""
        return time.perf_counter_ns() - self._t0

    def emit(self, cls: type[Event], /, **fields: Any) -> None:
        """Record one event of kind ``cls``; stamped with the current time and step."""
        if not self.enabled:
            return
        self._buf.append(cls(t=time.perf_counter_ns() - self._t0, step=self.step, **fields))
        if len(self._buf) >= _MAX_BUFFERED:
            self.flush()

    def extend(self, events: list[Event]) -> None:
        """Record events built by the caller, stamped with ``now()`` and ``step``: a producer of many
        events at one instant (attention statistics: one per row and layer) skips ``emit``'s per-event
        call and clock read."""
        if not self.enabled:
            return
        self._buf.extend(events)
        if len(self._buf) >= _MAX_BUFFERED:
            self.flush()

    def end_step(self, num_tokens: int = 0, **fields: Any) -> None:
        """Close the current step: emit ``step_end`` (with ``fields``: its optional ones), hand the batch
        to the sinks, advance."""
        now = time.perf_counter_ns()
        self.emit(StepEnd, num_tokens=num_tokens, duration_ns=now - self._step_t0, **fields)
        self.flush()
        self._step_t0 = now
        self.step += 1
        for hook in self._after_step:
            hook()

    def flush(self) -> None:
        if not self._buf:
            return
        batch, self._buf = self._buf, []
        for sink in self._sinks:
            sink(batch)
