"""The boundary between decode_layer.py and its C kernel: one argument struct declared in decode_layer.h,
mirrored by ``_Args`` and checked at load; kernels share code through headers, and a header edit rebuilds."""

from __future__ import annotations

import ctypes
import re
import shutil
from pathlib import Path

import pytest

from kvdoctor.engine.kernels import native
from kvdoctor.engine.model import decode_layer
from kvdoctor.engine.model.decode_layer import KernelMismatch, _Args, check_layout

KERNELS = native.source("decode_layer.c").parent
_SIGNATURES = {"kvdoctor_decode_layers": [ctypes.POINTER(_Args)], "kvdoctor_decode_args_layout": [],
               "kvdoctor_decode_args_names": []}


def _library(source: Path):
    lib = native.load(source, _SIGNATURES)
    if isinstance(lib, str):
        pytest.skip(f"no compiled kernels here: {lib}")
    return lib


def _copy_sources(tmp_path: Path) -> Path:
    for path in [*KERNELS.glob("*.c"), *KERNELS.glob("*.h")]:
        shutil.copy(path, tmp_path / path.name)
    return tmp_path / "decode_layer.c"


def test_the_kernel_is_loaded_with_the_layout_python_mirrors():
    # GIVEN the kernel built from the sources in engine/
    lib = _library(KERNELS / "decode_layer.c")
    # WHEN its struct's layout is compared with _Args
    check_layout(lib)  # THEN it raises nothing
    # AND the kernel the runner calls takes exactly a pointer to that struct: nothing else gets through ctypes
    kernel = decode_layer._kernel()
    assert kernel is not None and kernel.argtypes == [ctypes.POINTER(_Args)]
    with pytest.raises(ctypes.ArgumentError):
        kernel(1, 2, 3)


def test_a_kernel_built_with_another_layout_is_refused_with_the_fields_named(tmp_path):
    # GIVEN the sources with two fields of decode_args swapped in decode_layer.h (a header edited, its mirror not)
    source = _copy_sources(tmp_path)
    header = tmp_path / "decode_layer.h"
    text = header.read_text()
    assert "X(int64_t, nb) X(int64_t, bs)" in text
    header.write_text(text.replace("X(int64_t, nb) X(int64_t, bs)", "X(int64_t, bs) X(int64_t, nb)"))
    # WHEN the library built from them is loaded and checked
    lib = _library(source)
    # THEN it is refused before any call, with the mismatched fields named
    with pytest.raises(KernelMismatch, match=r"bs@\d+ != nb@\d+"):
        check_layout(lib)


def test_editing_a_header_changes_the_build_key_of_every_kernel_that_includes_it(tmp_path):
    # GIVEN copies of the kernels' sources and their build keys
    source = _copy_sources(tmp_path)
    before = {name: native.build_key("cc", tmp_path / name) for name in ("decode_layer.c", "matvec.c")}
    # WHEN matvec.h, which both include, changes
    (tmp_path / "matvec.h").write_text((tmp_path / "matvec.h").read_text() + "\n/* edited */\n")
    after = {name: native.build_key("cc", tmp_path / name) for name in before}
    # THEN both rebuild (neither key is the old one), and the unrelated digest kernel does not
    assert all(after[name] != before[name] for name in before)
    assert source.exists() and native.build_key("cc", tmp_path / "digest.c") == native.build_key("cc", KERNELS / "digest.c")


def test_no_kernel_includes_another_kernels_c_file():
    # GIVEN every C source and header in engine/
    sources = [*KERNELS.glob("*.c"), *KERNELS.glob("*.h")]
    # WHEN their local includes are read
    included = {p.name: re.findall(r'^#include "([^"]+)"', p.read_text(), flags=re.M) for p in sources}
    # THEN each names a header
    assert included["decode_layer.c"] and all(name.endswith(".h") for names in included.values() for name in names)
