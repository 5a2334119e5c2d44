"""C kernels compiled for this CPU on first use, their loops shared by kvdoctor's own thread pool.

Some hot loops are a few lines of C and many passes of torch: the decode step's matrix products
(``matvec``), the attention statistics of a step (``attention``), the content digests of the K/V a
step writes (``digest``). Each lives in a C file beside its module and is compiled here with the
system's C compiler for this CPU (``-march=native``), cached under ``~/.cache/kvdoctor/kernels``,
keyed by its source and the headers it includes, the flags and the CPU's feature flags. A kernel that
uses another's code includes that code's header (``matvec.h``), never its ``.c`` file: each library
exports only its own functions.

Their parallel loops run on ``pool.c``'s threads, not OpenMP's: the pool's wait can be bounded at run time
from the load (``pool.py`` says why). The pool is one library for the whole process, loaded before any
kernel with its symbols global, so every kernel's ``kvdoctor_parallel`` reaches the same threads (a pool per
library would have one set of threads spinning while another's work). Where a kernel cannot be built or
loaded (no compiler, not Linux) ``load`` says why, and the caller uses torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from ... import knobs
from ..paths import cache_home

__all__ = ["build_key", "function", "load", "pool_library", "source"]

_KERNELS = Path(__file__).parent


def source(name: str) -> Path:
    """A kernel's C source: every kernel lives in this folder, beside the headers they share."""
    return _KERNELS / name


_FLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def _texts(source: Path) -> list[bytes]:
    """``source`` and the local headers it includes (``#include "matvec.h"``), theirs too: all of them make the
    build's key, so editing a header rebuilds every library that includes it."""
    text = source.read_bytes()
    included = re.findall(rb'^#include "([^"]+)"', text, flags=re.M)
    return [text] + [t for name in included for t in _texts(source.with_name(name.decode()))]


def build_key(cc: str, source: Path) -> str:
    """What a built library is cached under: its sources (with every header they include), the compiler and
    flags, and this CPU's feature flags."""
    return hashlib.sha256(b"\0".join([*_texts(source), " ".join([cc, *_FLAGS]).encode(), _cpu_flags().encode()])).hexdigest()


def _build(cc: str, source: Path) -> Path:
    out = cache_home() / "kernels" / f"{source.stem}-{build_key(cc, source)[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, str(source), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: a process racing this one loads a whole library or builds its own
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def pool_library() -> ctypes.CDLL | str:
    """The thread pool's library (``pool.c``), built and loaded once with its symbols global, where the kernels
    loaded after it find ``kvdoctor_parallel``; or why it cannot be."""
    lib = _built(knobs.get(knobs.CC), source("pool.c"), ctypes.RTLD_GLOBAL)
    if isinstance(lib, str):
        return lib
    lib.kvdoctor_pool_spin.argtypes, lib.kvdoctor_pool_spin.restype = [ctypes.c_int64], None
    lib.kvdoctor_pool_workers.argtypes, lib.kvdoctor_pool_workers.restype = [], ctypes.c_int64
    return lib


def _built(cc: str, source: Path, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL | str:
    """``source`` built for this CPU and loaded, or why it cannot be."""
    try:
        return ctypes.CDLL(str(_build(cc, source)), mode=mode)
    except FileNotFoundError as exc:
        return f"no C compiler: {exc.filename or cc} not found"
    except subprocess.CalledProcessError as exc:
        return f"{cc} failed to build {source.name}: {exc.stderr.decode(errors='replace').strip()[-300:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot build or load {source.name}: {exc}"


def load(source: Path, signatures: dict[str, list]) -> ctypes.CDLL | str:
    """``source`` built for this CPU and loaded after the thread pool, its functions in ``signatures`` (name ->
    argument ctypes; they return nothing) typed; or why it cannot run here."""
    pool = pool_library()
    if isinstance(pool, str):
        return f"no thread pool for the kernels: {pool}"
    lib = _built(knobs.get(knobs.CC), source)
    if isinstance(lib, str):
        return lib
    try:
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
    except AttributeError as exc:
        return f"cannot load {source.name}: {exc}"
    return lib


def function(source: Path, name: str, argtypes: Sequence[type]) -> Callable[..., None] | None:
    """The one function ``name`` of ``source``, typed and loaded (see ``load``), or None where it cannot
    run here: the caller, which keeps it for the process, then takes its torch path."""
    lib = load(source, {name: list(argtypes)})
    return None if isinstance(lib, str) else getattr(lib, name)
