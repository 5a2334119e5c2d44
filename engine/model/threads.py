"""How many threads a step runs on: all of this process's CPUs when they are free, its fair share when other
processes want them.

A decode step is many short parallel regions (each compiled kernel's loop, each torch op), each ending in a
barrier. When another process holds one of the team's CPUs, the barrier waits for a descheduled thread, and
the threads that arrived spin while they wait: a step beside two single-threaded busy loops on two cores took
4.5× its quiet time, where a fair share of the CPUs (two of four runnable threads) would cost 2×. A team that
fits the CPUs the others leave has no such waits.

So the team follows the load. At most every ``interval`` seconds, at a step's start, the policy reads how much
CPU time other processes took on this process's CPUs since the last reading (``/proc/stat`` per CPU, less this
process's own time from ``/proc/self/stat``) and sizes the team to the CPUs they left, rounded to whole CPUs,
never above the size the process started with (the user's ``torch.set_num_threads`` or ``OMP_NUM_THREADS``)
and never below one. The team shrinks only for a load two readings in a row saw, and grows back at the first
reading that finds the CPUs free: a burst of someone else's work (a compiler, a page-cache flush, a kernel
thread) that shares one reading would otherwise halve a quiet run's team until the next reading, and a short
run is a handful of readings. The kernels and torch's ops share one OpenMP runtime (``engine.kernels.native``) and
every kernel takes ``torch.get_num_threads()``, so one ``torch.set_num_threads`` sizes them all. The size
changes only the split of the work, never its results: tokens are the same whatever the team.

Every policy in a process (a runner, a draft model's runner, an ``EngineCache`` under ``generate``) starts from
the user's setting, not from a team another policy has shrunk: the size the policies last set is kept here, and
a team torch reports at that size reads as the setting the user had before (``user_threads``).

``KVDOCTOR_THREADS=fixed`` keeps the team at its starting size (an A/B, or a machine where ``/proc`` lies).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ... import knobs

__all__ = ["ThreadPolicy", "cpu_busy", "others_busy", "user_threads"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy(cpus: set[int]) -> float | None:
    """Seconds the CPUs in ``cpus`` have spent busy since boot (every process's), or None without /proc."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            v = [int(x) for x in rest.split()]
            busy += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # user nice system irq softirq steal
    return busy / _TICK


def _own_busy() -> float:
    """Seconds this process has run, all of its threads."""
    t = os.times()
    return t.user + t.system


def others_busy(cpus: set[int], before: tuple[float, float, float] | None) -> tuple[float | None, tuple[float, float, float] | None]:
    """CPUs' worth of time other processes took on ``cpus`` since ``before`` (a previous reading), and this
    reading. None where /proc cannot tell."""
    busy = cpu_busy(cpus)
    if busy is None:
        return None, None
    now = (time.monotonic(), busy, _own_busy())
    if before is None or now[0] - before[0] <= 0:
        return None, now
    elapsed = now[0] - before[0]
    return max(0.0, (now[1] - before[1]) - (now[2] - before[2])) / elapsed, now


@dataclass
class _Setting:
    """The process's one record of what the policies did to torch's team (torch's is process-wide too)."""

    user: int = 0  # the team torch had before a policy last changed it: the user's setting
    set_to: int | None = None  # the size a policy last set; None until one does


_SETTING = _Setting()


def user_threads() -> int:
    """The team the user chose: torch's size now, unless that is the size a policy set, then the size before it."""
    now = torch.get_num_threads()
    return _SETTING.user if now == _SETTING.set_to else now


def _resize(team: int) -> None:
    """Set torch's team (and so every kernel's) to ``team``, remembering the user's setting it replaces."""
    _SETTING.user = user_threads()
    torch.set_num_threads(team)
    _SETTING.set_to = team


@dataclass
class ThreadPolicy:
    """Sizes the OpenMP team of the steps that follow from the load other processes put on this one's CPUs."""

    interval: float = 0.25  # seconds between two readings: long enough to average a step's bursts
    adaptive: bool = field(default_factory=lambda: knobs.get(knobs.THREADS) == "adaptive")
    base: int = field(default_factory=user_threads)  # the most the team may have: the user's setting
    team: int = 0  # the team's size now
    changes: int = 0  # how often the team changed size: a benchmark's evidence that the policy acted
    _cpus: set[int] = field(default_factory=set)
    _last: tuple[float, float, float] | None = None
    _seen: float = 0.0  # the others' load the previous reading saw: a shrink needs it too

    def __post_init__(self) -> None:
        self.team = self.base
        try:
            self._cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.adaptive = False

    def before_step(self) -> int:
        """The team for the step about to run: unchanged until ``interval`` has passed since the last reading."""
        if not self.adaptive or self.base <= 1:
            return self.team
        if self._last is not None and time.monotonic() - self._last[0] < self.interval:
            return self.team
        others, self._last = others_busy(self._cpus, self._last)
        if others is None:
            return self.team
        sustained, self._seen = min(others, self._seen), others
        team = max(1, min(self.base, round(len(self._cpus) - sustained)))  # a CPU others hold half of is theirs
        if team != self.team:
            _resize(team)
            self.team, self.changes = team, self.changes + 1
        return team

    def restore(self) -> None:
        """The process's threads as they were before the policy sized them (the runner closes); a size the user
        set since is left alone."""
        if self.team != self.base:
            if torch.get_num_threads() == self.team:
                _resize(self.base)
            self.team = self.base
