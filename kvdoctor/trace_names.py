"""Which file each trace of a workload goes to, so that no writer clobbers another's.

``KVDOCTOR_TRACE=run.kvtrace`` names the workload's first trace; every further trace of the same run
(another cache of the process, another process: a second vLLM engine core, a worker, a child the
workload spawned) goes beside it as ``run.2.kvtrace``, ``run.3.kvtrace`` … in the order they start, which
is the order ``kvdoctor check --trace DIR`` reads them in. A file written before the run began (by an
earlier run with the same setting) is replaced, as a re-run replaces its own trace; one written since
belongs to this run and is never written over. The run began when its process group's leader started:
the command a shell or ``kvdoctor check -- CMD`` started, whose children share its group.
"""

from __future__ import annotations

import os
import time

__all__ = ["numbered", "claim", "run_started_ns"]


def numbered(path: str, n: int) -> str:
    """``path`` for n = 1, else ``<stem>.<n>.kvtrace[.gz|.msgpack]`` beside it."""
    if n == 1:
        return path
    head, name = os.path.split(path)
    stem, dot, rest = name.partition(".kvtrace")
    if not dot:
        stem, rest = os.path.splitext(name)
    return os.path.join(head, f"{stem}.{n}{dot}{rest}")


def claim(path: str, first: int = 1) -> tuple[str, int]:
    """The first of ``numbered(path, first)``, ``numbered(path, first + 1)`` … that no writer of this run has
    written, and its number."""
    started = run_started_ns()
    n = first
    while True:
        candidate = numbered(path, n)
        try:
            if os.stat(candidate).st_mtime_ns < started:
                return candidate, n
        except OSError:
            return candidate, n
        n += 1


def run_started_ns() -> int:
    """Wall-clock ns when this run began: its process group leader's start (this process's where /proc says
    nothing of the leader; now where there is no /proc)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        for pid in (os.getpgrp(), os.getpid()):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    start = int(f.read().rsplit(b")", 1)[1].split()[19])
                return (boot * ticks + start) * 1_000_000_000 // ticks
            except OSError:
                continue
    except (OSError, ValueError, StopIteration):
        pass
    return time.time_ns()
