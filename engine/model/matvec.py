"""The decode step's matrix products on CPU: a small C kernel that reads each weight once, on both cores.

A decode step multiplies a few rows (one per sequence) by every weight of the model, so it is
bound by how fast the weights stream from memory. MKL's one-row product (``F.linear``) streams at
one core's bandwidth whether torch has one thread or two, and oneDNN's prepacked product does little
better; a plain loop split across the kernels' thread pool (``engine.kernels.pool``) streams at what both
cores give, and up to ``MAX_ROWS`` rows it beats both (figures: docs/benchmarks.md, "The decode path's
parts"). Above ``MAX_ROWS`` (prefill) MKL's GEMM is faster.
bfloat16 weights stream half the bytes: multiplied on AMX's tiles from 4 rows on where the CPU has them,
by AVX-512 BF16's dot products below that, and elsewhere widened to float32 in registers (two integer
operations per 16 weights). At 8 rows the products are as much compute as streaming, which is what the
tiles (and, in float32, AVX-512's 16-lane vectors over four rows a pass) are for.

The kernel (``matvec.c``) is built and loaded by ``native``; where it cannot be (no compiler) callers use
``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import knobs
from ..kernels import native, pool

__all__ = ["DTYPES", "MAX_ROWS", "Matvec", "load", "probe"]

MAX_ROWS = 16  # up to here the kernel beats MKL and oneDNN on SmolLM2's shapes; above, MKL's GEMM wins
_SOURCE = native.source("matvec.c")


DTYPES = (torch.float32, torch.bfloat16)  # of the weight; bias and y in float32, x too (bf16 with a bf16 weight)


@dataclass(frozen=True)
class Matvec:
    """``y = x @ w.T + b`` on CPU for ``x`` (M <= MAX_ROWS, K) and a contiguous ``w`` (N, K) of one of
    ``DTYPES``; ``y`` is float32 (a bf16 caller rounds it, as torch's bf16 product rounds its float32 sums).
    With a bf16 weight x is taken rounded to bf16, as torch's bf16 product takes its inputs."""

    kernels: dict[torch.dtype, ctypes._CFuncPtr]
    path: Path

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *, round_bf16: bool = False
                 ) -> torch.Tensor:
        """``round_bf16``: each output rounded to a bf16 value (still float32), as a bf16 product rounds."""
        x = x.to(torch.float32).contiguous()
        b = b.to(torch.float32) if b is not None else None
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        scratch = torch.empty_like(x) if w.dtype == torch.bfloat16 else None  # x as the bf16 kernel reads it
        self.kernels[w.dtype](x.data_ptr(), w.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(),
                              scratch.data_ptr() if scratch is not None else None,
                              x.shape[0], w.shape[0], w.shape[1], pool.team(), int(round_bf16))
        return y


@functools.cache
def probe() -> Matvec | str:
    """The compiled kernel, or why there is none here (see the module's notes); built once a process."""
    if not knobs.get(knobs.MATVEC):
        return "switched off by KVDOCTOR_MATVEC=0"
    args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib = native.load(_SOURCE, {"kvdoctor_matvec_f32": args, "kvdoctor_matvec_bf16": args})
    if isinstance(lib, str):
        return lib
    kernels = {torch.float32: lib.kvdoctor_matvec_f32, torch.bfloat16: lib.kvdoctor_matvec_bf16}
    return Matvec(kernels, Path(lib._name))


def load() -> Matvec | None:
    """The compiled kernel, or None where it cannot be built or loaded (``probe`` says why)."""
    kernel = probe()
    return kernel if isinstance(kernel, Matvec) else None
