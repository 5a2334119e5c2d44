"""The kernels' thread pool (``pool.c``): how many threads a kernel's loop takes, and how long a waiting thread
spins before it sleeps.

A decode step is ~211 short parallel loops in the compiled kernels. How their threads wait between loops
decides how the step fares beside other processes: spinning is fastest on free CPUs and ruinous when a team
mate is descheduled; sleeping is the reverse (docs/benchmarks.md, "Contention"). OpenMP fixes its wait when
torch loads; this pool's is set here, at any time, by the thread policy (``engine.model.threads``) from the
load it measures. Neither the team nor the spin changes a result: the kernels' iterations are independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native

__all__ = ["SPIN_US", "configure", "spin_us", "team", "workers"]

SPIN_US = 1000  # pool.c's own spin: what a process no policy has configured waits before sleeping


@dataclass
class _Setting:
    team: int | None = None  # the kernels' team a policy set; None: torch's (the user's setting)
    spin_us: int = SPIN_US


_SETTING = _Setting()


def team() -> int:
    """The threads a kernel's loop may take: the thread policy's team, or torch's setting where no policy set one
    (torch's ``set_num_threads`` or ``OMP_NUM_THREADS``, which a user sizes kvdoctor with)."""
    return _SETTING.team if _SETTING.team is not None else torch.get_num_threads()


def spin_us() -> int:
    """How long (microseconds) a pool thread waiting for work or for its team spins before it sleeps."""
    return _SETTING.spin_us


def configure(team: int | None, spin_us: int) -> None:
    """The kernels' team from now on (None: torch's again) and the pool's spin; no-op where there is no pool."""
    _SETTING.team = team
    if spin_us != _SETTING.spin_us:
        lib = native.pool_library()
        if not isinstance(lib, str):
            lib.kvdoctor_pool_spin(spin_us)
        _SETTING.spin_us = spin_us


def workers() -> int:
    """The pool's worker threads running in this process (the caller is the team's other thread); 0 without one."""
    lib = native.pool_library()
    return 0 if isinstance(lib, str) else int(lib.kvdoctor_pool_workers())
