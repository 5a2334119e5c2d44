"""The weights on 2 MB pages: a decode step streams every weight once, and on 4 KB pages that walk costs
one TLB entry each 4 KB.

A SmolLM2 decode step reads 270 MB (bf16) to 540 MB (fp32) of weights: on 4 KB pages that is 66,000 to
132,000 page translations a step, far more than the TLB holds, so each page's first read waits on a page
walk. On 2 MB pages the same weights take 135 to 270 translations. The gain is largest where a step is
most a stream of weights (fp32, batch 1) and vanishes where it is more compute than stream (bf16 at batch 8
on AMX tiles); the event path's cost after the stream is cache misses, not page walks, and is the same on
either (figures: docs/benchmarks.md, ``decode.py --page-pairs``).

Linux gives a private anonymous mapping 2 MB pages where it is advised ``MADV_HUGEPAGE`` and transparent
huge pages are not switched off (``/sys/kernel/mm/transparent_hugepage/enabled``: "always" or "madvise").
``Arena`` is such a mapping, aligned to 2 MB, that a model's weights are copied into once
(``weights.model_weights``); it lives as long as any tensor carved from it. Elsewhere (another OS, huge
pages "never", ``KVDOCTOR_HUGEPAGES=0``) there is no arena and the weights stay where the model put them.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
import weakref
from pathlib import Path
from typing import Callable

import torch

from ... import knobs

__all__ = ["HUGE_PAGE", "NOT_LINUX", "SWITCHED_OFF", "Arena", "enabled", "give_back", "holds", "unavailable"]

HUGE_PAGE = 1 << 21
_ALIGN = 4096  # each tensor starts on its own page: rows stay aligned for the kernels' vector loads
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_LIVE: weakref.WeakKeyDictionary[mmap.mmap, tuple[int, int]] = weakref.WeakKeyDictionary()  # arena -> its span


# why there are none (``unavailable``), besides the kernel's setting
SWITCHED_OFF = "switched off by KVDOCTOR_HUGEPAGES=0"
NOT_LINUX = "not Linux: no transparent huge pages"


def unavailable() -> str | None:
    """Why a mapping that asks gets no 2 MB pages here, or None when it does."""
    if not knobs.get(knobs.HUGEPAGES):
        return SWITCHED_OFF
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return NOT_LINUX
    try:
        if "[never]" in _SETTING.read_text():
            return f"transparent huge pages are switched off ({_SETTING}: never)"
    except OSError:  # no sysfs (a container without it): the kernel's default, which gives them when asked
        pass
    return None


def enabled() -> bool:
    """Whether a mapping that asks gets 2 MB pages here, and nobody switched it off."""
    return unavailable() is None


def holds(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a live arena (a model placed before keeps its weights where they are)."""
    if t.device.type != "cpu":
        return False
    at = t.data_ptr()
    return any(lo <= at < hi for lo, hi in list(_LIVE.values()))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError):
        return None


def give_back() -> None:
    """Hand the memory freed so far back to the OS: glibc keeps a freed chunk of its heap for reuse, so
    the old copies of weights moved into an arena would stay in the RSS beside their new copies."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _size(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Arena:
    """Tensors carved in order from one 2 MB-aligned mapping advised ``MADV_HUGEPAGE``: ``sized`` makes it
    for the tensors to copy in, ``take`` hands out the next one. Pages are only faulted (and
    counted in the RSS) as the copies write them, so a copy followed by dropping the old tensor never holds
    both whole."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._map.madvise(mmap.MADV_HUGEPAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._next = (-base) % HUGE_PAGE
        self._end = self._next + nbytes
        _LIVE[self._map] = (base, base + len(self._map))

    @classmethod
    def sized(cls, sizes: list[int]) -> Arena | None:
        """An arena for tensors of ``sizes`` bytes, taken in order; None when they would not fill one huge page
        or huge pages are not to be had (the tensors then stay where they are)."""
        nbytes = sum(_size(n) for n in sizes)
        if nbytes < HUGE_PAGE or not enabled():  # less than one huge page saves no translations
            return None
        try:
            return cls(nbytes)
        except (OSError, ValueError):  # no address space for it: the weights stay where they are
            return None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next ``shape`` tensor of ``dtype`` (uninitialised)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._next + nbytes > self._end:
            raise ValueError(f"arena full: {nbytes} bytes asked, {self._end - self._next} left")
        t = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=self._next)
        self._next += _size(nbytes)
        return t.view(dtype).view(shape)
