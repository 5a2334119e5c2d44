"""py-spy: the Python stacks of another process, and flame graphs of a workload.

py-spy reads a process's memory from outside (ptrace), so it needs permission the
kernel may refuse: Yama's ``ptrace_scope`` above 0 for a non-child, or a container
without the SYS_PTRACE capability. A refusal becomes ``PtraceDenied``, whose message
says how to fix it; a missing binary becomes ``PySpyNotFound``.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import KvdoctorError

__all__ = [
    "PySpyError", "PySpyNotFound", "PtraceDenied", "ThreadStack", "find_py_spy", "ptrace_status",
    "dump_stacks", "record_command", "let_parent_trace", "PTRACE_FIX",
]

PTRACE_FIX = (
    "run as root, or allow ptrace: `sudo sysctl kernel.yama.ptrace_scope=0`; "
    "in a container add the capability (`docker run --cap-add SYS_PTRACE`, "
    "Kubernetes securityContext.capabilities.add: [SYS_PTRACE])"
)
_CAP_SYS_PTRACE = 19
_PR_SET_PTRACER = 0x59616D61  # prctl option of the Yama LSM
_DENIED_MARKERS = ("permission denied", "operation not permitted", "os error 1)", "os error 13)")


class PySpyError(KvdoctorError):
    """py-spy ran but could not do what was asked (process gone, timeout, unsupported Python)."""


class PySpyNotFound(PySpyError):
    def __init__(self) -> None:
        super().__init__("py-spy is not installed: `pip install py-spy` (kvdoctor depends on it; reinstall with ./kvd)")


class PtraceDenied(PySpyError):
    def __init__(self, pid: int, detail: str) -> None:
        super().__init__(f"not permitted to read process {pid} with ptrace ({detail}); to fix: {PTRACE_FIX}")
        self.pid, self.detail = pid, detail


@dataclass(frozen=True)
class ThreadStack:
    thread_id: int
    name: str | None
    active: bool
    frames: tuple[str, ...]  # "function (file:line)", innermost first

    def lines(self) -> list[str]:
        """A header line for the thread, then its frames indented: how a finding shows it."""
        name = f" {self.name}" if self.name else ""
        return [f"Thread {self.thread_id}{name} ({'active' if self.active else 'idle'})",
                *(f"    {frame}" for frame in self.frames)]


def find_py_spy() -> str:
    """The py-spy beside this interpreter (a venv need not be on PATH), else the one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise PySpyNotFound()
    return found


def ptrace_status() -> dict[str, object]:
    """What decides whether py-spy may attach: uid, Yama's ptrace_scope, CAP_SYS_PTRACE.

    ``may_attach_child`` is the verdict for a child we started (the case kvdoctor needs):
    scope 0 or 1 allow it for the same user; scope 2 needs the capability; 3 forbids it.
    """
    scope: int | None
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = None  # no Yama: classic rules, same uid may attach
    cap = _has_capability(_CAP_SYS_PTRACE)
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if scope is None or scope <= 1:
        may = True
    elif scope == 2:
        may = bool(cap)
    else:
        may = False
    return {"euid": os.geteuid() if hasattr(os, "geteuid") else None, "root": root,
            "ptrace_scope": scope, "cap_sys_ptrace": cap, "may_attach_child": may}


def let_parent_trace() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a workload kvdoctor starts, so that py-spy may read it under ptrace_scope=1.

    Scope 1 (Ubuntu's default) lets only ancestors ptrace, and py-spy, started by kvdoctor
    later, is the workload's sibling. Before exec the child declares kvdoctor its tracer
    (``prctl(PR_SET_PTRACER)``); Yama then admits kvdoctor's descendants as well. None where
    it is not needed (no Yama, scope 0) or cannot help (scope 2 and 3 ignore declarations).
    """
    status = ptrace_status()
    if status["ptrace_scope"] != 1:
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only makes one call
    parent = os.getpid()

    def declare_tracer() -> None:
        libc.prctl(_PR_SET_PTRACER, parent, 0, 0, 0)

    return declare_tracer


def _has_capability(bit: int) -> bool | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError):
        pass
    return None


def _run(argv: list[str], pid: int | None, timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(os.environ, RUST_LIB_BACKTRACE="0"))
    except subprocess.TimeoutExpired as exc:
        raise PySpyError(f"py-spy did not answer within {timeout_s:g} s: {' '.join(argv[1:3])}") from exc
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        detail = next((line for line in lines if line.startswith("Error:")), lines[-1] if lines else "")
        detail = detail or f"exit status {done.returncode}"
        if pid is not None and any(m in done.stderr.lower() for m in _DENIED_MARKERS):
            raise PtraceDenied(pid, detail)
        raise PySpyError(f"py-spy failed: {detail}")
    return done


def dump_stacks(pid: int, *, timeout_s: float = 10.0, native: bool = False) -> list[ThreadStack]:
    """Every Python thread's stack in ``pid`` right now (py-spy pauses it for a moment)."""
    argv = [find_py_spy(), "dump", "--pid", str(pid), "--json"]
    if native:
        argv.append("--native")
    done = _run(argv, pid, timeout_s)
    threads = []
    for t in json.loads(done.stdout):
        frames = tuple(f"{f['name']} ({f.get('short_filename') or f['filename']}:{f['line']})" for f in t["frames"])
        threads.append(ThreadStack(thread_id=t["thread_id"], name=t.get("thread_name"),
                                   active=bool(t.get("active")), frames=frames))
    return threads


def record_command(
    output: Path, *, fmt: str, duration_s: float | None, rate_hz: int, subprocesses: bool,
    pid: int | None = None, command: list[str] | None = None,
) -> list[str]:
    """The py-spy argv that records ``pid`` (or runs and records ``command``) into ``output``."""
    argv = [find_py_spy(), "record", "--output", str(output), "--format", fmt, "--rate", str(rate_hz)]
    if duration_s is not None:
        argv += ["--duration", str(max(1, round(duration_s)))]
    if subprocesses:
        argv.append("--subprocesses")
    if pid is not None:
        return argv + ["--pid", str(pid)]
    assert command, "record_command needs a pid or a command"
    return argv + ["--", *command]
