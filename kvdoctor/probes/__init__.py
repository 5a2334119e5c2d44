"""Memory probes: RSS, the Python heap, torch and the GPU, read into the event stream.

Readings travel as ``mem`` events on the engine's bus, next to the KV events they
explain. Three ways to switch them on:

* in-process: ``attach_probes(bus, kv_bytes_fn, interval_s)`` with any bus, or
  ``attach_to_cache(cache)`` with a ``PagedKVCache``;
* a child workload (``kvdoctor watch -- python x.py``): ``KVDOCTOR_PROBES=1`` next to
  ``KVDOCTOR_TRACE``. The engine may not import this package, so it runs the
  ``kvdoctor.engine_hooks`` entry points when it builds a traced cache; ours is
  ``from_env``, which attaches when ``KVDOCTOR_PROBES`` asks for it;
* a workload of your own: call ``attach_to_cache(cache)`` after building the engine.

Importing this package is light (no torch); see docs/probes.md.
"""

from __future__ import annotations

from typing import Any

from .. import knobs
from ..errors import UsageError
from .prober import DEFAULT_INTERVAL_S, Prober, Reading
from .torch_mem import AccountingFn, cache_accounting

__all__ = [
    "DEFAULT_INTERVAL_S", "ENV_PROBES", "ENV_INTERVAL", "ENV_HEAP",
    "Prober", "Reading", "attach_probes", "attach_to_cache", "from_env",
]

ENV_PROBES, ENV_INTERVAL, ENV_HEAP = knobs.PROBES.name, knobs.PROBES_INTERVAL.name, knobs.PROBES_HEAP.name


def attach_probes(
    bus: Any, kv_bytes_fn: AccountingFn | None = None, interval_s: float = DEFAULT_INTERVAL_S, **options: Any,
) -> Prober:
    """Subscribe a ``Prober`` to ``bus`` and emit a first reading (``source="start"``).

    ``options`` go to ``Prober`` (``heap``, ``frame_limit``, ``gpu``, ``device_on_cpu``).
    Subscribing enables the bus, so attach where something else consumes it too.
    """
    prober = Prober(bus, kv_bytes_fn, interval_s=interval_s, **options)
    bus.subscribe(prober)
    prober.read_now("start")
    return prober


def attach_to_cache(cache: Any, interval_s: float = DEFAULT_INTERVAL_S, **options: Any) -> Prober:
    """``attach_probes`` on a ``PagedKVCache``: its bus, its ``stats()`` as the accounting."""
    options.setdefault("device_on_cpu", not cache.config.is_cuda)
    return attach_probes(cache.bus, cache_accounting(cache), interval_s, **options)


def from_env(cache: Any, *, default: bool = False) -> Prober | None:
    """The engine hook: attach to ``cache`` when ``KVDOCTOR_PROBES`` is on (unset: ``default``), else do nothing."""
    try:  # the interval and the heap are read only with the probes on: a value nobody uses is no error
        on = knobs.get(knobs.PROBES)
        if not (default if on is None else on):
            return None
        interval, heap = knobs.get(knobs.PROBES_INTERVAL), knobs.get(knobs.PROBES_HEAP)
    except knobs.KnobError as exc:  # the probes' callers (a workload's engine, kvdoctor run) expect a UsageError
        raise UsageError(str(exc)) from None
    return attach_to_cache(cache, interval, heap=heap)
