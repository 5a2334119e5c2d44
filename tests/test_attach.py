"""``kvdoctor check|watch --pid``: attach to a process already serving with kvdoctor's engine, check what it does
from then on, detach, and leave it running as it was."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

KVDOCTOR = [sys.executable, "-c", "from kvdoctor.cli import main; raise SystemExit(main())"]

SERVER = '''
import sys, time
from pathlib import Path
from kvdoctor.engine import Request, Runner, Scheduler
from kvdoctor.engine.model.model import tiny_llama

stop, mode = Path(sys.argv[1]), sys.argv[2]
runner = Runner.create(tiny_llama(num_layers=2).model, block_size=4, device_blocks=16, host_blocks=512,
                       prefix_cache=mode == "clean")
sched = Scheduler(runner, max_batch=4)
steps = 0
while not stop.exists():
    if len(sched.live) < 6:
        sched.submit(Request([1, 2, 3, 4, 5, 6, 7, 8] + list(range(10, 14 + steps % 9)),
                             max_new_tokens=12, ignore_eos=True))
    sched.step()  # STEP LINE
    steps += 1
    swapped = [seq for seq, live in sched.live.items() if live.state == "swapped"]
    if mode == "leak" and swapped and steps % 50 == 0:  # now and then, so the host tier never fills up
        sched.abort(swapped[0])  # ABORT LINE
    if steps == 40:
        print("serving", flush=True)
    time.sleep(0.002)
runner.close()
print("done", steps, flush=True)
'''
STEP_LINE, ABORT_LINE = (next(i for i, line in enumerate(SERVER.splitlines(), start=1) if mark in line)
                         for mark in ("STEP LINE", "ABORT LINE"))


@pytest.fixture
def env(tmp_path):
    return dict(os.environ, KVDOCTOR_ATTACH_DIR=str(tmp_path / "attach"))


def _serve(tmp_path, env, mode: str, fault: str | None = None) -> subprocess.Popen:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server_env = dict(env, **({"KVDOCTOR_FAULT": fault} if fault else {}))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "stop"), mode], env=server_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "serving", proc.stderr.read()
    return proc


def _stop(tmp_path, proc: subprocess.Popen) -> str:
    (tmp_path / "stop").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def test_check_attaches_to_a_clean_server_finds_nothing_and_leaves_it_serving(tmp_path, env):
    # GIVEN a process serving requests with kvdoctor's engine, untraced, 40 steps in
    proc = _serve(tmp_path, env, "clean")
    try:
        # WHEN kvdoctor attaches to it for two seconds
        run = subprocess.run([*KVDOCTOR, "check", "--pid", str(proc.pid), "--duration", "2"], env=env,
                             capture_output=True, text=True, timeout=120)
        # THEN its cache traces from a step's end on, snapshot first, and nothing is wrong with it
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"attached to process {proc.pid} at its step" in run.stderr
        assert "0 errors, 0 warnings, 0 info" in run.stdout
        # AND the request is taken back, the traces' folder removed
        assert not [p for p in (tmp_path / "attach").iterdir() if not p.name.startswith(".")]
    finally:
        out = _stop(tmp_path, proc)
    # AND the server went on serving to the end, as if nobody had looked
    assert out.startswith("done")


def test_check_finds_a_leak_in_a_running_server_and_names_the_users_line(tmp_path, env):
    # GIVEN a server that aborts requests while they are swapped out, with an engine that strands their blocks
    proc = _serve(tmp_path, env, "leak", fault="leak-swapped")
    try:
        run = subprocess.run([*KVDOCTOR, "check", "--pid", str(proc.pid), "--duration", "2", "--format", "sarif"],
                             env=env, capture_output=True, text=True, timeout=120)
    finally:
        _stop(tmp_path, proc)
    # THEN the gate fails on the leak, located at the server's own line whose step allocated the blocks, the line
    # that aborted the request beside it
    assert run.returncode == 1, run.stdout + run.stderr
    results = json.loads(run.stdout)["runs"][0]["results"]
    leaks = [r for r in results if r["ruleId"] == "leak/unreachable-swapped"]

    def lines(locations: list) -> set:
        return {loc["physicalLocation"]["region"]["startLine"] for loc in locations
                if loc["physicalLocation"]["artifactLocation"]["uri"].endswith("server.py")}

    assert leaks and STEP_LINE in set().union(*(lines(r["locations"]) for r in leaks))
    assert ABORT_LINE in set().union(*(lines(r["relatedLocations"]) for r in leaks))


def test_a_process_without_kvdoctors_engine_is_refused_with_the_reason(tmp_path, env):
    # GIVEN a Python process that runs no kvdoctor engine
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        run = subprocess.run([*KVDOCTOR, "check", "--pid", str(idle.pid), "--wait", "1"], env=env,
                             capture_output=True, text=True, timeout=60)
    finally:
        idle.kill()
        idle.wait()
    # THEN a usage error, in one line that says why and what to do, after the wait asked for
    assert run.returncode == 2 and time.monotonic() - start < 30
    assert "no kvdoctor engine in that process answered within 1 s" in run.stderr
    assert "kvdoctor watch -- CMD" in run.stderr and "Traceback" not in run.stderr
    # AND its request does not stay behind
    assert not (tmp_path / "attach" / f"{idle.pid}.request").exists()
    # AND a process that does not exist is one line too
    gone = subprocess.run([*KVDOCTOR, "check", "--pid", str(idle.pid)], env=env, capture_output=True, text=True)
    assert gone.returncode == 2 and "no such process" in gone.stderr


def test_watch_shows_a_running_server_from_the_moment_it_attaches(tmp_path, env, monkeypatch):
    from kvdoctor.cli import main
    from kvdoctor.tui.app import KvdoctorApp

    proc = _serve(tmp_path, env, "clean")
    monkeypatch.setenv("KVDOCTOR_ATTACH_DIR", env["KVDOCTOR_ATTACH_DIR"])
    seen: dict = {}

    def run_headless(app: KvdoctorApp) -> None:
        async def drive() -> None:
            async with app.run_test(size=(120, 40)) as pilot:
                for _ in range(300):  # until the screen shows the server's blocks
                    await pilot.pause(0.1)
                    shown = app.snapshot
                    seen.setdefault("log", []).append(None if shown is None else (
                        shown.step, [(t.name, t.used, t.owned, t.shared) for t in shown.tiers], shown.active_seqs))
                    if shown is not None and shown.step > 0 and any(t.owned + t.shared for t in shown.tiers):
                        break
                seen["snapshot"] = app.snapshot

        asyncio.run(drive())

    monkeypatch.setattr(KvdoctorApp, "run", run_headless)
    try:
        assert main(["watch", "--pid", str(proc.pid)]) == 0
    finally:
        _stop(tmp_path, proc)
    # THEN the screen showed the server's cache as it stood: its blocks and sequences, no finding
    shown = seen["snapshot"]
    assert shown.step > 40 and shown.findings == ()
    assert sum(t.owned + t.shared for t in shown.tiers) > 0 and shown.active_seqs > 0, seen["log"][-5:]
