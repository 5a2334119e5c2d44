"""The kernels' thread pool: the same results on any team and spin, one pool for every kernel library, safe
beside a second calling thread and after fork, and asleep when idle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvdoctor.engine.kernels import pool
from kvdoctor.engine.model.matvec import load

needs_kernel = pytest.mark.skipif(load() is None, reason="no C compiler")


@pytest.fixture
def spin():
    """Set the pool's spin for a test; the default again after it."""
    yield lambda us: pool.configure(None, us)
    pool.configure(None, pool.SPIN_US)


def _product(x: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """matvec.c's product of x (M, K) and w (N, K) on ``threads`` threads of the pool."""
    y = torch.empty(x.shape[0], w.shape[0])
    load().kernels[w.dtype](x.data_ptr(), w.data_ptr(), None, y.data_ptr(), None, x.shape[0], w.shape[0], w.shape[1],
                            threads, 0)
    return y


def _pool_threads() -> list[int]:
    """The ids of this process's threads the pool started (named by pool.c)."""
    ids = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "kvdoctor-pool":
                ids.append(int(tid))
    return ids


def _cpu_ticks(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


@needs_kernel
@pytest.mark.parametrize("m", [1, 8])
def test_a_product_is_the_same_to_the_bit_on_any_team_and_spin(spin, m):
    # GIVEN a product whose 4-row groups of w do not divide evenly among 2 or 3 threads
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 256, generator=g), torch.randn(1030, 256, generator=g)
    want = _product(x, w, 1)
    for us in (pool.SPIN_US, 0):
        spin(us)
        for threads in (2, 3, 5):
            # WHEN it runs on another team, spinning or sleeping THEN every output is the same bits
            assert torch.equal(_product(x, w, threads), want), (us, threads)


@needs_kernel
def test_two_python_threads_calling_kernels_at_once_each_get_their_own_result():
    # GIVEN two products, each one Python thread's, called over and over at the same time (ctypes lets go of
    # the GIL: the second caller finds the pool busy and runs its loop alone)
    g = torch.Generator().manual_seed(0)
    jobs = [(torch.randn(4, 512, generator=g), torch.randn(2048, 512, generator=g)) for _ in range(2)]
    want = [_product(x, w, 1) for x, w in jobs]
    wrong: list[int] = []

    def hammer(i: int) -> None:
        x, w = jobs[i]
        for _ in range(200):
            if not torch.equal(_product(x, w, 2), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # THEN both finish (no deadlock) and every result is its own product
    assert not any(t.is_alive() for t in threads) and wrong == []


@needs_kernel
def test_a_forked_child_starts_its_own_workers_and_computes_the_same():
    # GIVEN a parent whose pool has its worker running
    x, w = torch.randn(2, 128), torch.randn(512, 128)
    want = _product(x, w, 2)
    assert pool.workers() >= 1
    # WHEN it forks and the child multiplies on two threads
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if it had no workers, computed the same bits and started one
        code = 1
        try:
            before = pool.workers()
            code = 0 if before == 0 and torch.equal(_product(x, w, 2), want) and pool.workers() >= 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    # THEN the child did not use the parent's (absent) workers, did not hang, and got the parent's result
    assert os.waitstatus_to_exitcode(status) == 0


def _idle_ticks(settle_s: float) -> dict[int, int]:
    """CPU ticks each pool thread took over a second of idling, ``settle_s`` after a burst of two-thread products."""
    x, w = torch.randn(1, 256), torch.randn(1024, 256)
    for _ in range(200):
        _product(x, w, 2)
    workers = _pool_threads()
    assert workers
    time.sleep(settle_s)
    before = {tid: _cpu_ticks(tid) for tid in workers}
    time.sleep(1.0)
    return {tid: _cpu_ticks(tid) - before[tid] for tid in workers}


@needs_kernel
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc")
@pytest.mark.parametrize("spin_us, settle_s", [(20_000, 0.2), (10_000_000, 0.1)], ids=["past-spin", "call-returned"])
def test_the_pools_threads_sleep_once_idle(spin, spin_us, settle_s):
    # GIVEN the pool spinning 20 ms before it sleeps, or 10 s (a quiet machine's setting, stretched), after a
    # burst of products: kernel calls of one loop each, which return to torch's ops, whose own team wants the CPUs
    spin(spin_us)
    # WHEN the process leaves the pool idle past the spin, or only just past the last call's return
    ticks = _idle_ticks(settle_s)
    # THEN its threads took no CPU meanwhile (asleep on the futex, not spinning out the budget for a loop that
    # is not coming): at most a tick of rounding
    assert all(t <= 1 for t in ticks.values()), ticks


@needs_kernel
def test_every_kernel_library_shares_one_pool():
    # GIVEN a fresh process WHEN the product kernel and the digest kernel each run a loop on two threads
    code = """
import ctypes, numpy as np, torch
from kvdoctor.engine.kernels import pool
from kvdoctor.engine.kv.digest import _sums_kernel
from kvdoctor.engine.model.matvec import load
x, w = torch.randn(1, 64), torch.randn(256, 64)
y = torch.empty(1, 256)
load().kernels[torch.float32](x.data_ptr(), w.data_ptr(), None, y.data_ptr(), None, 1, 256, 64, 2, 0)
data, wt, out = np.ones((8, 4, 1, 4096), np.int32), np.ones((4, 4096), np.int64), np.zeros((8, 1), np.uint64)
_sums_kernel()(data.ctypes.data, data.strides[0], 8, 4, 1, 4096, 4096, 0, 4, wt.ctypes.data, out.ctypes.data, 1, 2)
assert (out == 4 * 4096).all()
print(pool.workers())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # THEN one worker serves both (one pool in the process, not one a library)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"]

