"""Attaching to a running process: ``kvdoctor watch --pid PID`` and ``kvdoctor check --pid PID``.

py-spy reads a process from outside; memray injects code into it with a debugger (gdb calling the
interpreter). kvdoctor needs neither: what it traces is produced inside the process by its own engine,
and every kvdoctor engine cache listens. At the end of a step, at most every ``POLL_S``, it looks in the
attach folder (``KVDOCTOR_ATTACH_DIR``) for a request named after its process: the trace to write and
the process that asks. The cache then opens a trace of its own there (the first cache ``run.kvtrace``,
the next ``run.2.kvtrace`` …), writes first a ``snapshot`` of what it holds, so the checks start from
the cache as it stands instead of reading the history they missed as leaks, traces every step from then
on and answers in the folder. Caches built while the request stands trace too. When the asker removes
its request or dies, each cache closes its trace at its next step.

Why no debugger: gdb's call into the interpreter of a process on this project's machines (Intel Xeon
with AMX, gdb 13.1) could not restore the registers afterwards ("Couldn't write extended state status")
and the process died of the interrupted system call (OSError, errno 514). A doctor must never harm its
patient, so kvdoctor does not inject. The price: only a process whose kvdoctor engine runs steps can be
attached (its caches, and ``EngineCache`` under transformers' ``generate``); anything else is started
under ``kvdoctor watch -- CMD`` or with ``KVDOCTOR_TRACE`` set.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import knobs
from .errors import UsageError

__all__ = ["POLL_S", "Request", "Attachment", "folder", "standing", "answer"]

POLL_S = 0.5  # how often a cache looks for a request: the wait before it attaches, and its cost (one stat)


@dataclass(frozen=True)
class Request:
    """What ``watch|check --pid`` asks of a process: write traces named like ``trace``, for as long as
    ``client`` lives and the request stands. ``key`` tells one request from the next."""

    trace: str
    client: int
    key: str


def folder(create: bool = False) -> Path:
    """Where requests and answers lie: the same for the asker and the process, both of one user."""
    path = Path(knobs.get(knobs.ATTACH_DIR) or Path(tempfile.gettempdir()) / f"kvdoctor-attach-{os.getuid()}")
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _request_file(pid: int) -> Path:
    return folder() / f"{pid}.request"


def _answer_file(pid: int, key: str) -> Path:
    return folder() / f"{pid}.{key}.answer"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: it exists
    return True


# ---- the process asked (its engine's caches call these at step ends) -----------------------------

_standing: dict[str, Any] = {"next": 0.0, "stat": None, "request": None}


def standing() -> Request | None:
    """The request that stands for this process now; the file is read again only when it changed, and at
    most every ``POLL_S`` for all the caches of the process together."""
    now = time.monotonic()
    if now < _standing["next"]:
        return _standing["request"]
    _standing["next"] = now + POLL_S
    path = _request_file(os.getpid())
    try:
        st = os.stat(path)
    except OSError:
        _standing["stat"] = _standing["request"] = None
        return None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    if stamp != _standing["stat"]:
        _standing["stat"] = stamp
        _standing["request"] = _read_request(path)
    request = _standing["request"]
    if request is not None and not _alive(request.client):
        _standing["request"] = None  # the asker died without taking its request back
        return None
    return request


def _read_request(path: Path) -> Request | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return Request(trace=str(raw["trace"]), client=int(raw["client"]), key=str(raw["key"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # half written, or not ours: looked at again when it changes


def answer(request: Request, trace: str, step: int, blocks: int, seqs: int) -> None:
    """Tell the asker a cache attached: the trace it writes and what its snapshot held."""
    line = json.dumps({"pid": os.getpid(), "trace": trace, "step": step, "blocks": blocks, "seqs": seqs})
    with open(_answer_file(os.getpid(), request.key), "a", encoding="utf-8") as f:
        f.write(line + "\n")


# ---- the asker ----------------------------------------------------------------------------------------


class Attachment:
    """A request to process ``pid`` to trace its caches into ``trace`` (and beside it), taken back on
    ``close``: the process's caches then close their traces at their next step."""

    def __init__(self, pid: int, trace: str) -> None:
        if pid == os.getpid():
            raise UsageError("--pid: that is kvdoctor itself")
        if pid <= 0 or not _alive(pid):
            raise UsageError(f"--pid {pid}: no such process")
        self.pid = pid
        self.trace = str(Path(trace).resolve())
        self.key = uuid.uuid4().hex[:12]
        self._file = _request_file(pid)
        self._open = False

    def start(self) -> "Attachment":
        folder(create=True)
        theirs = _read_request(self._file) if self._file.exists() else None
        if theirs is not None and _alive(theirs.client):
            raise UsageError(f"--pid {self.pid}: kvdoctor (pid {theirs.client}) is attached to it already")
        tmp = self._file.with_name(f".{self._file.name}.{self.key}")
        tmp.write_text(json.dumps({"trace": self.trace, "client": os.getpid(), "key": self.key}), encoding="utf-8")
        os.replace(tmp, self._file)  # whole or absent: the process never reads half a request
        self._open = True
        return self

    def answers(self) -> list[dict[str, Any]]:
        """One per cache that attached so far: its trace, the step it began at, what its snapshot held."""
        try:
            text = _answer_file(self.pid, self.key).read_text(encoding="utf-8")
        except OSError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """The answers, once the first came; a ``UsageError`` that says why when none comes in ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.answers()
            if found:
                return found
            if not _alive(self.pid):
                raise UsageError(f"--pid {self.pid}: the process exited before it attached")
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"--pid {self.pid}: no kvdoctor engine in that process answered within {timeout:g} s. A cache "
                    f"answers at the end of its next step (a process whose engine is idle attaches when it works "
                    f"again: try a longer --wait); a process without kvdoctor's engine cannot be attached "
                    f"(kvdoctor does not inject code with a debugger): start it under `kvdoctor watch -- CMD` "
                    f"or with KVDOCTOR_TRACE set. Request and answers lie in {folder()}")
            time.sleep(0.05)

    @property
    def active(self) -> bool:
        """Asked and not taken back."""
        return self._open

    def close(self) -> None:
        """Take the request back (the process's caches close their traces) and remove the answers."""
        if not self._open:
            return
        self._open = False
        mine = _read_request(self._file)
        if mine is not None and mine.key == self.key:
            self._file.unlink(missing_ok=True)
        _answer_file(self.pid, self.key).unlink(missing_ok=True)

    def __enter__(self) -> "Attachment":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
