"""The thread policy: the kernels' pool sleeps at once while other processes want the CPUs and spins when they
leave, the kernels keep the user's whole team while torch's follows the CPUs the others leave, neither goes
above the user's setting, and the tokens do not depend on them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from kvdoctor.engine import Request, Runner, SamplingParams, Scheduler
from kvdoctor.engine.kernels import pool
from kvdoctor.engine.model import threads as threads_mod
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.model.threads import ThreadPolicy, others_busy

CPUS = len(os.sched_getaffinity(0))


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    pool.configure(None, pool.SPIN_US)


def _policy(monkeypatch, readings, base):
    """A policy whose readings of the others' load are ``readings``, one a step, each past the interval."""
    it = iter(readings)
    monkeypatch.setattr(threads_mod, "others_busy", lambda cpus, before: (next(it), (0.0, 0.0, 0.0)))
    p = ThreadPolicy(interval=0.0, adaptive=True, base=base)
    p._cpus = set(range(4))
    return p


def test_the_team_takes_the_cpus_the_others_leave_and_gives_them_back(monkeypatch, restore_threads):
    # GIVEN a policy on 4 CPUs that may use 4 threads, and others' load going 0, 1, 2.6, 4, 4, then 0.3
    p = _policy(monkeypatch, [0.0, 1.0, 2.6, 4.0, 4.0, 0.3], base=4)
    # WHEN six steps start THEN the team is what a load seen twice in a row leaves, at least 1, back to 4 at the
    # first reading that finds the others gone
    assert [p.before_step() for _ in range(6)] == [4, 4, 3, 1, 1, 4]
    assert torch.get_num_threads() == 4 and p.changes == 3


def test_the_pool_sleeps_while_others_want_the_cpus_and_the_kernels_keep_the_whole_team(monkeypatch, restore_threads):
    # GIVEN a policy on 4 CPUs that may use 4 threads, and others' load going 0, 3, 3, 0, 3, 3
    p = _policy(monkeypatch, [0.0, 3.0, 3.0, 0.0, 3.0, 3.0], base=4)
    waits = []
    for _ in range(6):  # WHEN six steps start
        team = p.before_step()
        waits.append((team, pool.team(), pool.spin_us()))
    # THEN torch's team shrinks under the load two readings saw, the kernels' stays 4, and the pool's threads
    # sleep at once for as long as the load lasts, spinning again at the first free reading
    free, busy = (4, 4, threads_mod.SPIN_FREE_US), (1, 4, 0)
    assert waits == [free, free, busy, free, free, busy] and p.changes == 3
    # WHEN the policy closes under load THEN the pool is as in a process without a policy
    p.restore()
    assert pool.spin_us() == pool.SPIN_US and pool.team() == torch.get_num_threads() == 4


def test_a_burst_one_reading_saw_leaves_the_team_alone(monkeypatch, restore_threads):
    # GIVEN a quiet machine but for one reading that saw others take 1.5 of its 2 CPUs (a compiler, a flush)
    p = _policy(monkeypatch, [0.0, 1.5, 0.0, 0.1], base=2)
    p._cpus = {0, 1}
    # WHEN four steps start THEN the team keeps both CPUs throughout
    assert [p.before_step() for _ in range(4)] == [2, 2, 2, 2] and p.changes == 0


def test_the_first_reading_spans_the_time_since_import_and_counts_alone(monkeypatch, restore_threads):
    # GIVEN a policy made now: its first window starts where the engine was imported (the model's load lies
    # between), so its first step judges seconds of the others' load, not nothing
    assert ThreadPolicy(adaptive=True)._last == threads_mod._IMPORTED
    # GIVEN that first reading saw others take 3 of 4 CPUs, and the next ones a free machine
    p = _policy(monkeypatch, [3.0, 0.0, 0.0], base=4)
    # WHEN three steps start THEN the first already runs on the CPUs left (a burst cannot weigh in a window that
    # long), and the team is back at the first free reading
    assert [p.before_step() for _ in range(3)] == [1, 4, 4] and p.changes == 2


def test_the_team_never_exceeds_the_users_setting_and_fixed_never_moves(monkeypatch, restore_threads):
    # GIVEN the user chose 2 threads on a 4-CPU machine, and a quiet machine
    p = _policy(monkeypatch, [0.0, 0.0], base=2)
    assert [p.before_step(), p.before_step()] == [2, 2]
    # GIVEN the fixed policy under load THEN it keeps its size and reads nothing
    fixed = ThreadPolicy(adaptive=False, base=2)
    monkeypatch.setattr(threads_mod, "others_busy", lambda *a: pytest.fail("fixed read the load"))
    assert fixed.before_step() == 2


def test_a_policy_made_while_another_has_shrunk_the_team_starts_from_the_users_setting(monkeypatch, restore_threads):
    # GIVEN the user's 2 threads and a first policy (a runner) that shrank the team to 1 under load
    torch.set_num_threads(2)
    first = _policy(monkeypatch, [0.0, 3.0, 3.0], base=threads_mod.user_threads())  # then 3 of its 4 CPUs taken
    assert [first.before_step() for _ in range(3)] == [2, 2, 1] and torch.get_num_threads() == 1
    # WHEN a second policy is made now (a draft model's runner, a second runner in the same process)
    second = ThreadPolicy(adaptive=True)
    # THEN it may grow the team back to the user's 2, not only to the 1 it found
    assert second.base == 2
    # WHEN the first closes THEN the user's setting is back
    first.restore()
    assert torch.get_num_threads() == 2 and threads_mod.user_threads() == 2


def test_restore_leaves_a_setting_the_user_made_since(monkeypatch, restore_threads):
    # GIVEN a policy that shrank the team, then the user choosing 3 threads
    torch.set_num_threads(2)
    p = _policy(monkeypatch, [3.0, 3.0], base=2)
    p.before_step(), p.before_step()
    torch.set_num_threads(3)
    # WHEN the policy restores THEN the user's 3 stays, and is what a new policy starts from
    p.restore()
    assert torch.get_num_threads() == 3 and ThreadPolicy(adaptive=False).base == 3


def test_readings_are_spaced_by_the_interval(monkeypatch, restore_threads):
    # GIVEN a policy with a long interval, that has seen the others' load once already
    calls = []
    monkeypatch.setattr(threads_mod, "others_busy", lambda cpus, before: (calls.append(1), (4.0, (time.monotonic(), 0.0, 0.0)))[1])
    p = ThreadPolicy(interval=60.0, adaptive=True, base=4)
    p._cpus, p._seen, p._last = set(range(4)), 4.0, (time.monotonic() - 120.0, 0.0, 0.0)
    # WHEN five steps start THEN only the first reads the load
    for _ in range(5):
        p.before_step()
    assert len(calls) == 1 and p.team == 1


def test_busy_loops_beside_an_idle_process_read_as_the_others_load():
    # GIVEN a first reading, then busy loops on every CPU of this process while it sleeps
    _, first = others_busy(set(os.sched_getaffinity(0)), None)
    if first is None:
        pytest.skip("no /proc/stat here")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(CPUS)]
    try:
        time.sleep(1.0)
        others, _ = others_busy(set(os.sched_getaffinity(0)), first)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    # THEN most of the CPUs read as taken by others (the loops start and the machine may host more)
    assert others is not None and others >= 0.6 * CPUS


@pytest.mark.skipif(CPUS < 2, reason="one CPU: every team is one thread")
def test_tokens_are_the_same_whatever_the_team(restore_threads):
    # GIVEN the same requests decoded with a team of 1 and a team of 2
    model = tiny_llama(num_layers=2).model
    out = []
    for team in (1, 2):
        torch.set_num_threads(team)
        with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
            runner.threads = ThreadPolicy(adaptive=False, base=team)
            sched = Scheduler(runner, max_batch=3)
            for n in (5, 9, 13):
                sched.submit(Request(list(range(1, n + 1)), max_new_tokens=12, ignore_eos=True))
            out.append(sorted(tuple(g.token_ids) for g in sched.run().values()))
    # THEN the tokens are identical
    assert out[0] == out[1]


@pytest.mark.skipif(CPUS < 2, reason="one CPU: every team is one thread")
def test_sampling_runs_on_the_calling_thread_alone_and_leaves_the_team(monkeypatch, restore_threads):
    # GIVEN a scheduler sampling with top-p under torch's team of 2, and the team each sampling saw
    from kvdoctor.engine.serving import scheduler as scheduler_mod

    seen = []
    verify = scheduler_mod.verify
    monkeypatch.setattr(scheduler_mod, "verify", lambda *a: (seen.append(torch.get_num_threads()), verify(*a))[1])
    torch.set_num_threads(2)
    with Runner.create(tiny_llama(num_layers=2).model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        runner.threads = ThreadPolicy(adaptive=False, base=2)
        sched = Scheduler(runner, max_batch=2)
        for n in (5, 9):
            sched.submit(Request(list(range(1, n + 1)), max_new_tokens=4, ignore_eos=True,
                                 sampling=SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=n)))
        sched.run()
        # THEN every token was sampled on one thread (no libgomp region left spinning beside the kernels' pool),
        # and the team is the user's again between steps
        assert seen == [1] * 8
        assert torch.get_num_threads() == 2
