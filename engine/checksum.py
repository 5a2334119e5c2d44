"""Swap checksums: a 64-bit wrapping sum of each block's bytes, taken in the same pass as the copy.

The checksum of a block is the sum of its bytes read as little-endian 64-bit words, modulo
2^64, padding included. Any change of one word, a block's bytes landing in another slot, a
zeroed or truncated page all change it; it runs at memory speed, which a cryptographic hash
would not. It is an opaque value to everything else (compared for equality, carried in
``checksum_error`` events), so only this module defines it.

*Why fused.* A copy that is checked costs a second trip over the bytes unless the check is
made while the bytes are in registers. Measured on a 2-core AMD EPYC (Zen, AVX2), 90 MiB of
KV blocks, medians of interleaved runs (docs/benchmarks.md): a plain memcpy 6.6-7.7 GB/s; copy
then sum in cache-sized pieces 0.79-0.83x of it (numpy's sum), xxh3 from ``xxhash`` 0.79-0.83x,
CRC32C from ``crc32c`` 0.75x (both hash from cache at 24-48 GB/s, but the second pass is
what costs); one loop that stores each word and adds it to the sum, compiled by numba (LLVM
vectorises it), 1.00-1.07x. The kernel is made by ``prepare`` when an engine with a slower tier
starts (compiled once, then loaded from numba's cache on disk: 0.6-1.5 s a process, most of it
numba's own import), in a thread of its own, so neither importing the engine nor its first steps
wait for it (the demo's first token came 0.8 s later when they did); a swap before it is ready waits.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch

from .digest import MASK64

__all__ = ["prepare", "copy_sum", "sum64", "sum64_rows"]


_kernel_lock = threading.Lock()  # one build: prepare's thread and a first swap may ask at once


def _copy_sum_kernel() -> Any:
    with _kernel_lock:
        return _build_kernel()


@functools.cache
def _build_kernel() -> Any:
    import numba  # imported here: numba's import and the compilation cost a second, paid in prepare()

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def copy_sum_rows(dst: np.ndarray, src: np.ndarray, sums: np.ndarray) -> None:  # pragma: no cover - compiled
        # dst, src: (n, W) int64 with contiguous rows; one pass: every word is stored and added
        for i in range(src.shape[0]):
            s = np.int64(0)
            for j in range(src.shape[1]):
                w = src[i, j]
                dst[i, j] = w
                s += w
            sums[i] = s

    return copy_sum_rows


def prepare() -> None:
    """Start making the copy kernel ready (compiled or loaded, for the contiguous blocks swaps pass it)."""
    if _build_kernel.cache_info().currsize == 0:
        threading.Thread(target=_warm, name="kvdoctor-checksum-kernel", daemon=True).start()


def _warm() -> None:
    blocks = np.zeros((1, 8), dtype=np.uint8)
    copy_sum(blocks.copy(), blocks)


def _words(rows: np.ndarray) -> np.ndarray:
    """``(n, W)`` int64 view of a 2-D array of whole blocks (rows of a multiple of 8 bytes, contiguous within)."""
    assert rows.ndim == 2 and rows.strides[1] == rows.itemsize, f"rows must be contiguous within: {rows.strides}"
    return rows.view(np.int64)


def _unsigned(sums: np.ndarray) -> list[int]:
    return sums.view(np.uint64).tolist()  # the wrapping sum, read as 0 .. 2^64-1 (== value & MASK64)


def copy_sum(dst: np.ndarray, src: np.ndarray) -> list[int]:
    """Copy ``src`` into ``dst`` (both ``(n, nbytes)`` of whole blocks, any dtype) and return each block's
    checksum, in one pass over the bytes."""
    assert dst.shape == src.shape and dst.dtype == src.dtype, f"{dst.shape}/{dst.dtype} vs {src.shape}/{src.dtype}"
    sums = np.empty(src.shape[0], dtype=np.int64)
    _copy_sum_kernel()(_words(dst), _words(src), sums)
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
