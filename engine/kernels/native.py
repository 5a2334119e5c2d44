"""C kernels compiled for this CPU on first use, run on torch's own OpenMP threads.

Some hot loops are a few lines of C and many passes of torch: the decode step's matrix products
(``matvec``), the attention statistics of a step (``attention``), the content digests of the K/V a
step writes (``digest``). Each lives in a C file beside its module and is compiled here with the
system's C compiler for this CPU (``-march=native``), cached under ``~/.cache/kvdoctor/kernels``,
keyed by its source and the headers it includes, the flags and the CPU's feature flags. A kernel that
uses another's code includes that code's header (``matvec.h``), never its ``.c`` file: each library
exports only its own functions.

A library links ``libgomp.so.1``, the OpenMP runtime torch's wheel loads, so its threads are torch's
threads: a second runtime would have two pools spinning against each other on the same cores.
``load`` asks the dynamic loader which runtime the library's OpenMP calls reach (each source defines
``kvdoctor_openmp_symbol`` for that) and uses it only if that is a ``libgomp.so.1`` mapped before it
was loaded (torch's; other packages' private copies, such as sentencepiece's renamed libgomp, do not
count). Where that cannot hold (no compiler, not Linux, another runtime) ``load`` says why, and the
caller uses torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch

from ... import knobs
from ..paths import cache_home

__all__ = ["build_key", "function", "library_of", "load", "source"]

_KERNELS = Path(__file__).parent


def source(name: str) -> Path:
    """A kernel's C source: every kernel lives in this folder, beside the headers they share."""
    return _KERNELS / name


_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


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


def _mapped_libgomp() -> set[str]:
    with open("/proc/self/maps") as fh:
        return {os.path.realpath(line.split()[-1]) for line in fh if "/libgomp" in line}


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


def library_of(address: int) -> str | None:
    """The path of the shared library that holds ``address`` (glibc's ``dladdr``)."""
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.fname:
        return None
    return os.path.realpath(info.fname.decode())


def load(source: Path, signatures: dict[str, list]) -> ctypes.CDLL | str:
    """``source`` built for this CPU and loaded, its functions in ``signatures`` (name -> argument
    ctypes; they return nothing) typed; or why it cannot run here on torch's threads."""
    if not torch.backends.openmp.is_available():
        return "this torch build has no OpenMP thread pool to share"
    cc = knobs.get(knobs.CC)
    try:
        before = _mapped_libgomp()  # torch's, loaded with torch
        lib = ctypes.CDLL(str(_build(cc, source)))
        lib.kvdoctor_openmp_symbol.restype = ctypes.c_void_p
        runtime = library_of(lib.kvdoctor_openmp_symbol())
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
    except FileNotFoundError as exc:
        return f"no C compiler: {exc.filename or cc} not found"
    except subprocess.CalledProcessError as exc:
        return f"{cc} failed to build {source.name}: {exc.stderr.decode(errors='replace').strip()[-300:]}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return f"cannot build or load {source.name}: {exc}"
    if runtime not in before or not os.path.basename(runtime).startswith("libgomp.so"):
        return f"its OpenMP calls reach {runtime}, not the libgomp torch loaded: two thread pools would fight"
    return lib


def function(source: Path, name: str, argtypes: Sequence[type]) -> Callable[..., None] | None:
    """The one function ``name`` of ``source``, typed and loaded (see ``load``), or None where it cannot
    run here: the caller, which keeps it for the process, then takes its torch path."""
    lib = load(source, {name: list(argtypes)})
    return None if isinstance(lib, str) else getattr(lib, name)
