"""The decode step's matrix products on CPU: a small C kernel that reads each weight once, on both cores.

A decode step multiplies a few rows (one per sequence) by every weight of the model, so it is
bound by how fast the weights stream from memory. On the 2-core AMD EPYC we measure on, MKL's
one-row product (``F.linear``) runs at one core's bandwidth (11-12 GB/s) whether torch has one
thread or two, and oneDNN's prepacked product does little better; a plain loop split across
torch's own OpenMP threads streams 17-20 GB/s, and for up to 16 rows beats both (SmolLM2's
linear weights, medians, docs/benchmarks.md). Above ``MAX_ROWS`` (prefill) MKL's GEMM is faster.
bfloat16 weights are widened to float32 in registers (two integer operations per 16 weights), so they
stream half the bytes.

The kernel (``matvec.c``) is compiled on first use with the system's C compiler for this CPU
(``-march=native``) and cached under ``~/.cache/kvdoctor/kernels``, keyed by its source, the flags
and the CPU's feature flags. It links ``libgomp.so.1``, the OpenMP runtime torch's wheel loads, so
its threads are torch's threads: a second runtime would have two pools spinning against each other
on the same cores. ``load`` asks the dynamic loader which runtime the library's OpenMP calls reach
and uses it only if that is a ``libgomp.so.1`` mapped before it was loaded (torch's; other packages'
private copies, such as sentencepiece's renamed libgomp, do not count). Where that cannot hold (no
compiler, not Linux, another runtime) ``load`` returns None and callers use ``F.linear``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .model import models_dir

__all__ = ["DTYPES", "MAX_ROWS", "Matvec", "load", "probe"]

MAX_ROWS = 16  # up to here the kernel beats MKL and oneDNN on SmolLM2's shapes; above, MKL's GEMM wins
_SOURCE = Path(__file__).with_name("matvec.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


DTYPES = (torch.float32, torch.bfloat16)  # of the weight; x, the bias and y are computed in float32


@dataclass(frozen=True)
class Matvec:
    """``y = x @ w.T + b`` on CPU for ``x`` (M <= MAX_ROWS, K) and a contiguous ``w`` (N, K) of one of
    ``DTYPES``; ``y`` is float32 (a bf16 caller rounds it, as torch's bf16 product rounds its float32 sums)."""

    kernels: dict[torch.dtype, ctypes._CFuncPtr]
    path: Path

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        b = b.to(torch.float32) if b is not None else None
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        scratch = torch.empty_like(x) if w.dtype == torch.bfloat16 else None  # x reordered as bf16 lanes pair up
        self.kernels[w.dtype](x.data_ptr(), w.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(),
                              scratch.data_ptr() if scratch is not None else None,
                              x.shape[0], w.shape[0], w.shape[1], torch.get_num_threads())
        return y


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(cc: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join([cc, *_FLAGS]).encode(), _cpu_flags().encode()])).hexdigest()
    out = models_dir().parent / "kernels" / f"matvec-{key[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: a process racing this one loads a whole library or builds its own
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _mapped_libgomp() -> set[str]:
    with open("/proc/self/maps") as fh:
        return {os.path.realpath(line.split()[-1]) for line in fh if "/libgomp" in line}


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


def _library_of(address: int) -> str | None:
    """The path of the shared library that holds ``address`` (glibc's ``dladdr``)."""
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.fname:
        return None
    return os.path.realpath(info.fname.decode())


@functools.cache
def probe() -> Matvec | str:
    """The compiled kernel, or why there is none here (see the module's notes); built once a process."""
    if os.environ.get("KVDOCTOR_MATVEC", "1") == "0":
        return "switched off by KVDOCTOR_MATVEC=0"
    if not torch.backends.openmp.is_available():
        return "this torch build has no OpenMP thread pool to share"
    cc = os.environ.get("CC", "cc")
    try:
        before = _mapped_libgomp()  # torch's, loaded with torch
        lib = ctypes.CDLL(str(_build(cc)))
        lib.kvdoctor_openmp_symbol.restype = ctypes.c_void_p
        runtime = _library_of(lib.kvdoctor_openmp_symbol())
        kernels = {torch.float32: lib.kvdoctor_matvec_f32, torch.bfloat16: lib.kvdoctor_matvec_bf16}
    except FileNotFoundError as exc:
        return f"no C compiler: {exc.filename or cc} not found"
    except subprocess.CalledProcessError as exc:
        return f"{cc} failed to build {_SOURCE.name}: {exc.stderr.decode(errors='replace').strip()[-300:]}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return f"cannot build or load the kernel: {exc}"
    if runtime not in before or not os.path.basename(runtime).startswith("libgomp.so"):
        return f"its OpenMP calls reach {runtime}, not the libgomp torch loaded: two thread pools would fight"
    for fn in kernels.values():
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
    return Matvec(kernels, Path(lib._name))


def load() -> Matvec | None:
    """The compiled kernel, or None where it cannot run sharing torch's threads (``probe`` says why)."""
    kernel = probe()
    return kernel if isinstance(kernel, Matvec) else None
