"""A cache's trace switched on from the environment: with ``KVDOCTOR_TRACE=/path/run.kvtrace`` set, every cache
writes a trace of its own, the run's first to that path, the 2nd, 3rd … (of this process or another of the run)
to ``run.2.kvtrace``, ``run.3.kvtrace`` … beside it, and the ``kvdoctor.engine_hooks`` entry points (kvdoctor's memory probes)
attach to it, since the engine may not import them.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.metadata
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ... import knobs
from ...events import Header, TierSpec
from ...trace_names import claim
from ..config import Tier
from .attached import AttachedTrace

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["HOOKS_GROUP", "trace_path", "header", "EnvTrace"]

# Entry points called with the cache when a trace is switched on by KVDOCTOR_TRACE: consumers that
# must run inside the workload (kvdoctor's memory probes) attach so, as the engine may not import them.
HOOKS_GROUP = "kvdoctor.engine_hooks"

_traced: dict[str, int] = {}  # absolute trace path -> the number of the last trace this process took there
_traced_lock = threading.Lock()


def trace_path(path: str) -> str:
    """The file a cache switched on by ``KVDOCTOR_TRACE=path`` writes: ``path`` itself for the run's first
    cache, then ``<stem>.2.kvtrace``, ``<stem>.3.kvtrace`` … beside it for the next ones, of this process or
    of another process of the run (closed or not), so no cache clobbers another's trace
    (``kvdoctor.trace_names``)."""
    key = os.path.abspath(path)
    with _traced_lock:
        found, n = claim(path, _traced.get(key, 0) + 1)
        _traced[key] = n
    return found


def header(cache: PagedKVCache) -> Header:
    """The trace header describing ``cache``: its geometry, tiers and codecs, and who wrote it."""
    c = cache.config
    return Header(
        block_size=c.block_size,
        num_layers=c.num_layers,
        tiers=[TierSpec(name=t, capacity_blocks=c.capacity(t),
                        codec="mixed" if c.mixed and t == Tier.DEVICE else c.tier_codec(t),
                        io=cache.arenas[t].io if t == Tier.DISK else None) for t in c.tiers],
        model=c.extra.get("model"),
        engine="kvdoctor.engine",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        pid=os.getpid(),
        t0=time.time_ns() - cache.bus.now(),  # wall clock at the bus's t = 0: orders this trace among others
        calibration=f"{c.calibration.source} (digest {c.calibration.digest})" if c.calibration else None,
    )


class EnvTrace:
    """The trace file and hooks of a cache, when ``KVDOCTOR_TRACE`` asks for them; nothing otherwise."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._writer: Any = None
        self._attached: list[Any] = []  # what the hooks attached; each has detach()
        self.on_request = AttachedTrace(cache, trace_path)  # the trace ``kvdoctor watch|check --pid`` may ask for

    def open(self) -> None:
        """Start the trace and call the hooks if ``KVDOCTOR_TRACE`` names a file (once the cache is whole)."""
        path = knobs.get(knobs.TRACE)
        if not path:
            return
        from ...trace import TraceWriter

        cache = self.cache
        self._writer = TraceWriter(trace_path(path), cache.header())
        cache.bus.subscribe(self._writer.write_many)
        atexit.register(cache.close)
        for hook in importlib.metadata.entry_points(group=HOOKS_GROUP):
            attached = hook.load()(cache)
            if attached is not None:
                self._attached.append(attached)

    def detach(self) -> None:
        """Let the hooks go (before the cache's last events are flushed)."""
        for attached in self._attached:
            attached.detach()

    def close(self) -> None:
        """Close the trace files (after the cache's last events are flushed)."""
        self.on_request.close()
        if self._writer is not None:
            self.cache.bus.unsubscribe(self._writer.write_many)
            self._writer.close()
            self._writer = None
            atexit.unregister(self.cache.close)
