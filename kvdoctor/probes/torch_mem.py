"""Memory that torch holds: the engine's own tensors, and CUDA's caching allocator.

tracemalloc does not see torch's allocations, and torch has no public counter for
CPU tensors, so the engine's bytes come from the engine's own accounting: a callable
returning bytes per tier (``cache.stats()`` underneath, see ``cache_accounting``).
On CUDA, torch's allocator reports what live tensors use (allocated) and what it
keeps from the driver (reserved); NVML's per-process figure minus reserved is the
CUDA context and anything allocated outside torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..events import TIERS

__all__ = ["AccountingFn", "EngineBytes", "engine_bytes", "cache_accounting", "CudaAllocator", "CudaReading"]

# Bytes per tier ("device", "host", "disk") of KV the engine holds; optionally also
# "cpu_tensors": bytes of every torch CPU tensor the engine holds (arenas with their
# unused capacity). Called on the engine's thread only, at step boundaries.
AccountingFn = Callable[[], Mapping[str, int]]


@dataclass(frozen=True)
class EngineBytes:
    kv: int  # KV bytes in all tiers
    cpu_tensors: int  # torch CPU tensor bytes the engine accounts for
    by_tier: dict[str, int] = field(default_factory=dict)


def engine_bytes(accounting: Mapping[str, int], device_on_cpu: bool) -> EngineBytes:
    """Fold an accounting mapping into totals; without "cpu_tensors" the CPU-resident tiers count.

    The disk tier is memory-mapped files: its pages are the page cache's, not torch's.
    """
    by_tier = {tier: int(accounting.get(tier, 0)) for tier in TIERS}
    if "cpu_tensors" in accounting:
        cpu = int(accounting["cpu_tensors"])
    else:
        cpu = by_tier["host"] + (by_tier["device"] if device_on_cpu else 0)
    return EngineBytes(kv=sum(by_tier.values()), cpu_tensors=cpu, by_tier=by_tier)


def cache_accounting(cache: Any) -> AccountingFn:
    """An ``AccountingFn`` over a ``PagedKVCache``, from ``cache.stats()``.

    KV bytes per tier are the tier's ``used_bytes``; the CPU tensor bytes are the whole
    ``arena_bytes`` of the arenas in host memory (the host arena, and the device arena
    when the engine runs on the CPU): an arena holds its free capacity too.
    """
    device_on_cpu = not cache.config.is_cuda

    def accounting() -> dict[str, int]:
        tiers = cache.stats()["tiers"]
        out = {tier: int(entry["used_bytes"]) for tier, entry in tiers.items()}
        cpu_tiers = ("host", "device") if device_on_cpu else ("host",)
        out["cpu_tensors"] = sum(int(tiers[t]["arena_bytes"]) for t in cpu_tiers if t in tiers)
        return out

    return accounting


@dataclass(frozen=True)
class CudaReading:
    allocated: list[int]  # per device, bytes held by live tensors
    reserved: list[int]  # per device, bytes the caching allocator holds

    @property
    def total_allocated(self) -> int:
        return sum(self.allocated)

    @property
    def total_reserved(self) -> int:
        return sum(self.reserved)


class CudaAllocator:
    """torch.cuda allocated/reserved, read only in a process that already uses torch with CUDA.

    Never imports torch and never initialises CUDA: a probe must not change what it measures.
    """

    def __init__(self) -> None:
        torch = sys.modules.get("torch")
        self._cuda = torch.cuda if torch is not None and torch.cuda.is_available() else None

    @property
    def available(self) -> bool:
        return self._cuda is not None

    def read(self) -> CudaReading | None:
        cuda = self._cuda
        if cuda is None or not cuda.is_initialized():
            return None
        devices = range(cuda.device_count())
        return CudaReading(
            allocated=[cuda.memory_allocated(d) for d in devices],
            reserved=[cuda.memory_reserved(d) for d in devices],
        )
