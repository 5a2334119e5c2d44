"""Swap checksums: a 64-bit wrapping sum of each block's bytes, taken in the same pass as the copy.

The checksum of a block is the sum of its bytes read as little-endian 64-bit words, modulo
2^64, padding included. Any change of one word, a block's bytes landing in another slot, a
zeroed or truncated page all change it; it runs at memory speed, which a cryptographic hash
would not. It is an opaque value to everything else (compared for equality, carried in
``checksum_error`` events), so only this module defines it.

*Why fused.* A copy that is checked costs a second trip over the bytes unless the check is
made while the bytes are in registers: copying and then hashing from cache (numpy's sum, xxh3,
CRC32C) loses a sixth to a third of a memcpy's bandwidth however fast the hash, because the
second pass is what costs; one loop that stores each word and adds it to the sum runs at memcpy's speed.
``checksum.c`` is that loop with non-temporal stores for large batches: regular stores read each
destination line before writing it, a third trip over the bytes that memcpy's string moves skip.
Where no C compiler is, numpy copies and then sums: two passes, correct, slower. Figures per CPU:
docs/benchmarks.md, "Engine tiers". The kernel is made by ``prepare`` when an engine with a slower
tier starts (compiled once, then loaded from a cache on disk), in a thread of its own, so neither importing
the engine nor its first steps wait for it; a swap before it is ready waits.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable

import numpy as np
import torch

from ..kernels import native
from .digest import MASK64

__all__ = ["prepare", "copy_sum", "sum64", "sum64_rows"]


_kernel_lock = threading.Lock()  # one build: prepare's thread and a first swap may ask at once
_STREAM_BYTES = 4 << 20  # a batch from this size on is copied with non-temporal stores (checksum.c)


def _copy_sum_kernel() -> Callable[[np.ndarray, np.ndarray, np.ndarray, bool], None]:
    with _kernel_lock:
        return _build_kernel()


@functools.cache
def _build_kernel() -> Callable[[np.ndarray, np.ndarray, np.ndarray, bool], None]:
    """``kernel(dst, src, sums, stream)`` over ``(n, W)`` int64 rows: the compiled C kernel (``stream``: with
    non-temporal stores), else numpy's two passes where no C compiler is (a copy, then the sum)."""
    c = ctypes
    compiled = native.function(native.source("checksum.c"), "kvdoctor_copy_sum",
                               (c.c_void_p, c.c_void_p, *(c.c_int64,) * 4, c.c_int, c.c_void_p))
    if compiled is None:
        return _numpy_copy_sum

    def copy_sum_rows(dst: np.ndarray, src: np.ndarray, sums: np.ndarray, stream: bool) -> None:
        compiled(dst.ctypes.data, src.ctypes.data, dst.shape[0], dst.shape[1], dst.strides[0] // 8,
                 src.strides[0] // 8, int(stream), sums.ctypes.data)

    return copy_sum_rows


def _numpy_copy_sum(dst: np.ndarray, src: np.ndarray, sums: np.ndarray, stream: bool) -> None:
    """The same checksum without a compiler: numpy's integer reduction wraps modulo 2^64 as the C loop does."""
    np.copyto(dst, src)
    np.add.reduce(src, axis=1, out=sums)


def prepare() -> None:
    """Start making the copy kernel ready (compiled or loaded, for the contiguous blocks swaps pass it)."""
    if _build_kernel.cache_info().currsize == 0:
        threading.Thread(target=_warm, name="kvdoctor-checksum-kernel", daemon=True).start()


def _warm() -> None:
    blocks = np.zeros((1, 8), dtype=np.uint8)
    copy_sum(blocks.copy(), blocks)


def _words(rows: np.ndarray) -> np.ndarray:
    """``(n, W)`` int64 view of a 2-D array of whole blocks (rows of a multiple of 8 bytes, contiguous within)."""
    assert rows.ndim == 2 and rows.strides[1] == rows.itemsize and rows.strides[0] % 8 == 0, \
        f"rows must be contiguous within, 8-byte multiples apart: {rows.strides}"
    return rows.view(np.int64)


def _unsigned(sums: np.ndarray) -> list[int]:
    return sums.view(np.uint64).tolist()  # the wrapping sum, read as 0 .. 2^64-1 (== value & MASK64)


def copy_sum(dst: np.ndarray, src: np.ndarray, *, keep: bool = False) -> list[int]:
    """Copy ``src`` into ``dst`` (both ``(n, nbytes)`` of whole blocks, any dtype) and return each block's
    checksum, in one pass over the bytes. ``keep``: ``dst`` is read again soon (a disk write's bounce buffer,
    which the transfer reads next), so its stores go through the caches whatever the batch's size."""
    assert dst.shape == src.shape and dst.dtype == src.dtype, f"{dst.shape}/{dst.dtype} vs {src.shape}/{src.dtype}"
    sums = np.empty(src.shape[0], dtype=np.int64)
    _copy_sum_kernel()(_words(dst), _words(src), sums, not keep and dst.nbytes >= _STREAM_BYTES)
    return _unsigned(sums)


def sum64_rows(rows: np.ndarray) -> list[int]:
    """The checksum of each row of a 2-D numpy array of whole blocks (any dtype, rows of a multiple of 8 bytes):
    where there is nothing to copy (the bytes came by DMA), numpy's reduction runs at memory speed."""
    return _unsigned(np.add.reduce(_words(rows), axis=1))


def sum64(blocks: torch.Tensor) -> list[int]:
    """The checksum of each block of an ``(n, L, H, R)`` tensor, where it is (a GPU sums on the GPU)."""
    words = blocks.view(torch.int64).reshape(blocks.shape[0], -1)
    if words.is_cuda:
        return [v & MASK64 for v in words.sum(dim=1).tolist()]
    return sum64_rows(words.numpy())
