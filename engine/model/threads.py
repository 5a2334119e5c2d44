"""How a step's threads wait and how many there are: spinning on all of this process's CPUs when they are free,
sleeping at once when other processes want them.

A decode step is ~211 short parallel loops in kvdoctor's compiled kernels (7 a layer, the lm head's product;
torch's ops open none while decoding), each ending when its slowest thread does. When another process holds
one of the team's CPUs, a loop waits for a descheduled thread, and threads that spin while they wait burn the
slices it needs: on libgomp's spin a step beside two single-threaded busy loops on two cores took 4-13× its
quiet time, where a fair share of the CPUs (two of four runnable threads) would cost 2×. Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) came close to that share but cost 9-14% on a quiet machine, and libgomp's wait is
fixed when torch loads. A team shrunk to the CPUs the others leave (this policy's answer before) gets a third
of a CPU less than a full team that sleeps: 0.099 s a token at batch 1 beside two loops, against PASSIVE's 0.059.

So the kernels run on their own pool (``engine.kernels.pool``), whose wait this policy sets at run time, and
their team stays the user's whole setting. At most every ``interval`` seconds, at a step's start, the policy
reads how much CPU time other processes took on this process's CPUs since the last reading (``/proc/stat`` per
CPU, less this process's own time from ``/proc/self/stat``). Where they left fewer whole CPUs than the team, a
pool thread that waits (for work, or for its team mates) sleeps at once; where they left them all, it spins for
``SPIN_FREE_US`` first, through the gaps between a step's loops. The pool's caller also takes any share of a
loop no worker has started, so a sleeping or descheduled worker costs its share's work, not a wait. Torch's
own team (prefill's products and the other torch ops) still shrinks to the CPUs the others leave, rounded to
whole CPUs and never below one: torch's ops run on libgomp, whose threads still spin in every barrier as the
kernels' did there, and a team that fits the CPUs left has no barrier to wait at for a descheduled mate.

A load counts only when two readings in a row saw it, and the policy goes back to spinning (and torch's team
to its size) at the first reading that finds the CPUs free: a burst of someone else's work (a compiler, a
page-cache flush, a kernel thread) that shares one reading would otherwise slow a quiet run until the next
reading, and a short run is a handful of readings. The first reading is the exception: it is taken at the first
step over the time since this module was imported (the model's load, seconds), too long for a burst to weigh,
and counts alone. Before, the first half second of a run (its first prefill, on a full libgomp team spinning in
every barrier) went unjudged, and beside two busy loops that one prefill took 19.6 s of the serve example's
run on a shared machine, against 0.7 s for each later one on the shrunk team. Neither the team nor the wait
changes a result: tokens are the same whatever they are.

Every policy in a process (a runner, a draft model's runner, an ``EngineCache`` under ``generate``) starts from
the user's setting, not from a team another policy has shrunk: the size the policies last set is kept here, and
a team torch reports at that size reads as the setting the user had before (``user_threads``).

Torch's small ops run on the calling thread alone (``torch_alone``) where a team has nothing to gain: sampling a
token (a dozen elementwise passes over the vocabulary's 49152 logits, each past torch's grain, so each opens a
parallel region). libgomp's worker spins ~6 ms after every region (its spin count, fixed when torch loads), so
after a step's sampling it was still spinning when the next decode step's kernels woke the pool's worker on the
same CPU, and the two took turns on it through the step's first loops: in the serve example, which samples with
top-p, libgomp's worker ran ~5 ms inside each decode step's kernel call (0.5 s over its 97 decode steps; 0.09 s
with sampling alone, most of it after its prefill steps). Greedy decode takes its argmax in numpy: no region.

``KVDOCTOR_THREADS=fixed`` keeps both as they start: torch's team, and the pool spinning as it does where no
policy runs (an A/B, or a machine where ``/proc`` lies).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ... import knobs
from ..kernels import pool

__all__ = ["SPIN_FREE_US", "ThreadPolicy", "cpu_busy", "others_busy", "torch_alone", "user_threads"]

SPIN_FREE_US = pool.SPIN_US  # CPUs free: a waiting pool thread spins this long, across a step's gaps, first

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


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


_IMPORTED_CPUS = _affinity()
# where every policy's first window starts: the model's load lies between this and a runner's first step
_IMPORTED = others_busy(_IMPORTED_CPUS, None)[1] if _IMPORTED_CPUS else None


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


@contextmanager
def torch_alone() -> Iterator[None]:
    """Torch's ops in the block run on the calling thread alone (its team as it was after): ops too small for a
    team to pay off, which would only wake libgomp's worker and leave it spinning where the kernels' pool wants
    the CPU next. Not a policy's change: ``user_threads`` still reads the team the block restores."""
    team = torch.get_num_threads()
    if team == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(team)


@dataclass
class ThreadPolicy:
    """Sets the wait of the kernels' pool and the size of torch's team for the steps that follow, from the load
    other processes put on this one's CPUs."""

    interval: float = 0.25  # seconds between two readings: long enough to average a step's bursts
    adaptive: bool = field(default_factory=lambda: knobs.get(knobs.THREADS) == "adaptive")
    base: int = field(default_factory=user_threads)  # the most the team may have: the user's setting
    team: int = 0  # torch's team now (the kernels' is always base)
    spin_us: int = SPIN_FREE_US  # the pool's spin now: SPIN_FREE_US, or 0 while others want the CPUs
    changes: int = 0  # how often the team or the spin changed: a benchmark's evidence that the policy acted
    _cpus: set[int] = field(default_factory=set)
    _last: tuple[float, float, float] | None = None
    _seen: float = math.inf  # the others' load the previous reading saw: a slow-down needs it too (not the first)
    _configured: bool = False  # a reading has set the pool's wait

    def __post_init__(self) -> None:
        self.team = self.base
        cpus = _affinity()
        if cpus is None:
            self.adaptive = False
            return
        self._cpus = cpus
        if cpus == _IMPORTED_CPUS:
            self._last = _IMPORTED

    def before_step(self) -> int:
        """Torch's team for the step about to run: unchanged until ``interval`` has passed since the last reading."""
        if not self.adaptive or self.base <= 1:
            return self.team
        if self._last is not None and time.monotonic() - self._last[0] < self.interval:
            return self.team
        others, self._last = others_busy(self._cpus, self._last)
        if others is None:
            return self.team
        sustained, self._seen = min(others, self._seen), others
        team = max(1, min(self.base, round(len(self._cpus) - sustained)))  # a CPU others hold half of is theirs
        spin = SPIN_FREE_US if team == self.base else 0
        pool.configure(self.base, spin)  # at every reading: another policy's restore may have reset it
        self._configured = True
        if team != self.team or spin != self.spin_us:
            if team != self.team:
                _resize(team)
            self.team, self.spin_us, self.changes = team, spin, self.changes + 1
        return team

    def restore(self) -> None:
        """The process's threads as they were before the policy sized them (the runner closes); a size the user
        set since is left alone."""
        if self.team != self.base:
            if torch.get_num_threads() == self.team:
                _resize(self.base)
            self.team = self.base
        if self._configured:
            pool.configure(None, SPIN_FREE_US)
            self.spin_us = SPIN_FREE_US
