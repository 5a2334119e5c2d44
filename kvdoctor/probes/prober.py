"""The Prober: memory readings as ``mem`` events in the engine's own event stream.

It is a bus sink, so it runs on the engine's thread at step boundaries: when
``interval_s`` has passed since its last reading it takes one and emits it into the
same bus, and ``read_now`` takes one on demand (a finding fired). No thread of its own:
the bus and the engine's accounting are not thread-safe, and a reading taken between
steps never races an allocation or breaks the rule that ``t`` never decreases. An idle
engine takes no readings; nothing the engine does changes while it is idle.

A reading's ``unaccounted`` is RSS minus the Python heap minus the torch CPU tensors the
engine accounts for: native leaks, tensors outside the engine (weights, activations),
allocator slack, the interpreter itself. Its level is a baseline; its slope is the signal.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .. import knobs
from ..events import Event, Mem
from .heap import DEFAULT_FRAME_LIMIT, HeapProbe
from .nvml import Nvml, NvmlReading
from .rss import RssProbe
from .torch_mem import AccountingFn, CudaAllocator, CudaReading, EngineBytes, engine_bytes

__all__ = ["DEFAULT_INTERVAL_S", "Reading", "Prober"]

DEFAULT_INTERVAL_S: float = knobs.PROBES_INTERVAL.default


@dataclass(frozen=True)
class Reading:
    """One reading with every detail (per device, per tier); ``mem_fields`` is what goes on the wire."""

    rss: int | None
    py_heap: int | None
    engine: EngineBytes | None
    cuda: CudaReading | None
    nvml: NvmlReading | None
    duration_ns: int  # what the reading cost

    def mem_fields(self) -> dict[str, int | None]:
        torch_cpu = self.engine.cpu_tensors if self.engine else None
        unaccounted = None
        if self.rss is not None:
            unaccounted = self.rss - (self.py_heap or 0) - (torch_cpu or 0)
        gpu_used = None
        if self.nvml is not None:
            gpu_used = self.nvml.process_used
        if gpu_used is None and self.cuda is not None:
            gpu_used = self.cuda.total_allocated
        return {
            "rss": self.rss, "py_heap": self.py_heap, "torch_cpu": torch_cpu,
            "gpu_used": gpu_used, "gpu_reserved": self.cuda.total_reserved if self.cuda else None,
            "kv_bytes": self.engine.kv if self.engine else None, "unaccounted": unaccounted,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, as plain data (a finding's attribution, ``kvdoctor doctor --json``)."""
        out: dict[str, Any] = dict(self.mem_fields())
        if self.engine is not None:
            out["kv_by_tier"] = dict(self.engine.by_tier)
        if self.cuda is not None:
            out["cuda_allocated"], out["cuda_reserved"] = list(self.cuda.allocated), list(self.cuda.reserved)
        if self.nvml is not None:
            out["gpu_devices"] = [asdict(d) for d in self.nvml.devices]
        out["duration_ns"] = self.duration_ns
        return out


class Prober:
    """Takes readings and emits them on ``bus`` (anything with ``emit(cls, **fields)``).

    ``kv_bytes_fn`` is the engine's accounting (``torch_mem.AccountingFn``); ``device_on_cpu``
    says whether the engine's device tier is host memory (no CUDA). ``heap=True`` starts
    tracemalloc for ``py_heap`` and heap attribution. It is off by default because its cost
    is per allocation, not per reading: it slowed decode 4-5x on a small model
    (benchmarks/probes.py --heap), while every other probe costs well under 1%.
    """

    def __init__(
        self,
        bus: Any,
        kv_bytes_fn: AccountingFn | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        heap: bool = False,
        frame_limit: int = DEFAULT_FRAME_LIMIT,
        gpu: bool = True,
        device_on_cpu: bool | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.bus = bus
        self.interval_s = interval_s
        # The engine's thread: only there may a reading call the accounting and emit.
        self.thread_id = threading.get_ident()
        self._kv_bytes_fn = kv_bytes_fn
        self.rss = RssProbe()
        self.heap = HeapProbe(frame_limit) if heap else None
        self.cuda = CudaAllocator() if gpu else None
        self.nvml = Nvml() if gpu else None
        if device_on_cpu is None:
            device_on_cpu = not (self.cuda is not None and self.cuda.available)
        self._device_on_cpu = device_on_cpu
        self._last = float("-inf")
        self._detached = False
        self.last: Reading | None = None
        self.num_readings = 0
        self.total_ns = 0  # time spent taking readings: the probes' whole cost on the engine's thread

    def take(self) -> Reading:
        """A reading, without emitting it."""
        t0 = time.perf_counter_ns()
        accounting: Mapping[str, int] | None = self._kv_bytes_fn() if self._kv_bytes_fn else None
        rss = self.rss.read()
        py_heap = self.heap.read() if self.heap else None
        cuda = self.cuda.read() if self.cuda else None
        nvml = self.nvml.read() if self.nvml else None
        reading = Reading(
            rss=rss, py_heap=py_heap, cuda=cuda, nvml=nvml,
            engine=engine_bytes(accounting, self._device_on_cpu) if accounting is not None else None,
            duration_ns=time.perf_counter_ns() - t0,
        )
        self.last = reading
        self.num_readings += 1
        self.total_ns += reading.duration_ns
        return reading

    def read_now(self, source: str = "demand") -> Reading:
        """Take a reading and emit it as a ``mem`` event whose ``source`` says why it was taken.

        Call it on the engine's thread (``thread_id``), like the bus's sinks are called.
        """
        self._last = time.monotonic()
        reading = self.take()
        self.bus.emit(Mem, source=source, **reading.mem_fields())
        return reading

    def __call__(self, events: list[Event]) -> None:
        """Bus sink: at each step boundary, a reading when the interval has passed."""
        if not self._detached and time.monotonic() - self._last >= self.interval_s:
            self.read_now("interval")

    def detach(self) -> None:
        """Stop emitting (the bus delivers what is buffered first) and release the probes."""
        self._detached = True  # unsubscribing flushes, which would call this sink once more
        self.bus.unsubscribe(self)
        self.close()

    def close(self) -> None:
        self.rss.close()
        if self.heap is not None:
            self.heap.close()
        if self.nvml is not None:
            self.nvml.close()
