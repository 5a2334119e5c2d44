"""What this machine supports, item by item: the facts behind ``kvdoctor doctor``.

Every inspection returns an ``Item`` and never raises: a machine without a GPU, NVML,
ptrace permission or the embedded model is a machine doctor describes, not one it
fails on. ``ok`` is True (works), False (does not; ``fix`` says what to do) or None
(not applicable, e.g. no GPU on a CPU machine).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .nvml import Nvml
from .pyspy import PySpyError, dump_stacks, find_py_spy, let_parent_trace, ptrace_status

__all__ = ["Item", "inspect_machine", "INSPECTIONS"]

_GiB = 1 << 30


@dataclass
class Item:
    name: str
    ok: bool | None
    summary: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_item() -> Item:
    return Item("python", True, f"{platform.python_version()} ({sys.executable}) on {platform.platform()}",
                data={"version": platform.python_version(), "executable": sys.executable,
                      "platform": platform.platform(), "cpus": os.cpu_count()})


def torch_item() -> Item:
    try:
        import torch
    except ImportError as exc:
        return Item("torch", False, f"not importable: {exc}", fix="reinstall with ./kvd (it installs torch)")
    data: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if not data["cuda_available"]:
        why = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build, no usable GPU"
        return Item("torch", True, f"{torch.__version__}, {why}: the device tier runs in host memory", data=data)
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    data.update(devices=names, cudnn=torch.backends.cudnn.version(), bf16=torch.cuda.is_bf16_supported())
    return Item("torch", True, f"{torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}",
                data=data)


def transformers_item() -> Item:
    version = _version("transformers")
    if version is None:
        return Item("transformers", False, "not installed", fix="reinstall with ./kvd")
    return Item("transformers", True, version, data={"version": version})


def nvml_item() -> Item:
    nvml = Nvml()
    try:
        if not nvml.available:
            return Item("gpu/nvml", None, f"no NVML: {nvml.reason}", data={"reason": nvml.reason})
        reading = nvml.read()
        assert reading is not None
        devices = [asdict(d) for d in reading.devices]
        listing = "; ".join(f"{d['index']}: {d['name']}, {d['used'] / _GiB:.1f}/{d['total'] / _GiB:.1f} GiB used"
                            for d in devices)
        return Item("gpu/nvml", True, f"driver {nvml.driver_version}, {len(devices)} device(s): {listing or 'none'}",
                    data={"driver": nvml.driver_version, "devices": devices})
    finally:
        nvml.close()


def pyspy_item(*, try_dump: bool = True, timeout_s: float = 10.0) -> Item:
    try:
        exe = find_py_spy()
    except PySpyError as exc:
        return Item("py-spy", False, str(exc), fix="pip install py-spy")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout_s).stdout.strip()
    status = ptrace_status()
    data: dict[str, Any] = {"path": exe, "version": version, **status}
    scope = "no Yama LSM" if status["ptrace_scope"] is None else f"ptrace_scope={status['ptrace_scope']}"
    who = "root" if status["root"] else f"uid {status['euid']}"
    cap = {True: "CAP_SYS_PTRACE", False: "no CAP_SYS_PTRACE", None: "capabilities unknown"}[status["cap_sys_ptrace"]]
    summary = f"{version} at {exe}; {who}, {scope}, {cap}"
    if not try_dump:
        return Item("py-spy", status["may_attach_child"], summary, data=data)
    ok, detail, fix = _try_dump(timeout_s)
    data["dump_test"] = detail
    return Item("py-spy", ok, f"{summary}; dump of a child process: {detail}", fix=fix, data=data)


def _try_dump(timeout_s: float) -> tuple[bool, str, str | None]:
    """Dump a throwaway child's stacks, started as kvdoctor starts workloads: the only sure test."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, preexec_fn=let_parent_trace())
    try:
        assert child.stdout is not None
        child.stdout.readline()  # the interpreter is up: py-spy can find its state
        t0 = time.perf_counter()
        try:
            threads = dump_stacks(child.pid, timeout_s=timeout_s)
        except PySpyError as exc:
            return False, f"failed: {exc}", "see the message: " + str(exc).split("to fix: ")[-1]
        frames = sum(len(t.frames) for t in threads)
        return True, f"works ({len(threads)} thread(s), {frames} frame(s) in {time.perf_counter() - t0:.2f} s)", None
    finally:
        child.kill()
        child.wait()


def disk_item(disk_dir: str | None = None) -> Item:
    where = disk_dir or tempfile.gettempdir()
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Item("disk tier", False, f"cannot inspect {where}: {exc}", fix="pass --disk-dir to a writable directory")
    writable = os.access(where, os.W_OK)
    summary = f"{usage.free / _GiB:.1f} GiB free of {usage.total / _GiB:.1f} GiB in {where}"
    return Item("disk tier", writable, summary if writable else f"{summary}, not writable",
                fix=None if writable else "set EngineConfig.disk_dir to a writable directory",
                data={"dir": where, "free": usage.free, "total": usage.total, "writable": writable})


def model_item() -> Item:
    try:
        from ..engine.model import model
    except ImportError as exc:  # the engine needs torch; torch_item says more
        return Item("model", False, f"engine not importable: {exc}", fix="reinstall with ./kvd")
    try:
        gguf = model.embedded_gguf()
    except model.ModelLoadError as exc:
        return Item("model", False, f"{model.EMBEDDED_NAME} is not installed", fix=str(exc))
    target = model.converted_dir(gguf)
    problem = "not converted yet" if not target.is_dir() else model.verify_copy(target, full=False)
    data = {"name": model.EMBEDDED_NAME, "gguf": str(gguf), "converted_dir": str(target), "converted": problem is None}
    if problem is None:
        return Item("model", True, f"{model.EMBEDDED_NAME} installed and converted ({target})", data=data)
    return Item("model", True, f"{model.EMBEDDED_NAME} installed ({gguf.name}); safetensors copy: {problem}",
                fix="it is converted on first use (about 20 s), or now with engine.model.model.convert_embedded()",
                data=data)


def decode_kernel_item() -> Item:
    """Whether the runner's CPU decode kernel builds here and shares torch's threads (engine/model/matvec.py)."""
    from ..engine.model import matvec

    kernel = matvec.probe()
    if isinstance(kernel, str):
        return Item("decode kernel", False, f"not used: {kernel}; decode steps fall back to F.linear (slower)",
                    fix="install a C compiler with OpenMP (gcc), or set CC to one", data={"reason": kernel})
    return Item("decode kernel", True, f"built for this CPU, on torch's threads ({kernel.path})",
                data={"path": str(kernel.path)})


def huge_pages_item() -> Item:
    """Whether the runner's weights go on 2 MB pages here (engine/model/hugepages.py)."""
    from ..engine.model import hugepages

    why = hugepages.unavailable()
    if why is None:
        return Item("huge pages", True, "the runner's weights go on 2 MB pages (decode streams them with fewer "
                    "page walks)")
    if why == hugepages.NOT_LINUX:
        return Item("huge pages", None, why, data={"reason": why})
    fix = ("unset KVDOCTOR_HUGEPAGES" if why == hugepages.SWITCHED_OFF else
           "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled")
    return Item("huge pages", False, f"not used: {why}; the weights stay on 4 KB pages (decode 3-10% slower)",
                fix=fix, data={"reason": why})


INSPECTIONS: dict[str, Callable[..., Item]] = {
    "python": python_item, "torch": torch_item, "transformers": transformers_item, "gpu/nvml": nvml_item,
    "py-spy": pyspy_item, "disk tier": disk_item, "model": model_item, "decode kernel": decode_kernel_item,
    "huge pages": huge_pages_item,
}


def inspect_machine(*, disk_dir: str | None = None, try_dump: bool = True) -> list[Item]:
    """Every inspection; one that crashes is reported as such, never raised."""
    items = []
    for name, inspect in INSPECTIONS.items():
        kwargs: dict[str, Any] = {}
        if inspect is disk_item:
            kwargs["disk_dir"] = disk_dir
        elif inspect is pyspy_item:
            kwargs["try_dump"] = try_dump
        try:
            items.append(inspect(**kwargs))
        except Exception as exc:  # an inspection's own bug must not hide the other answers
            items.append(Item(name, False, f"could not inspect: {type(exc).__name__}: {exc}"))
    return items
