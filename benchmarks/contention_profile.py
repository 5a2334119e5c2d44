"""Where a decode step's time goes under contention: a sampled profile (``perf record``) of kvdoctor's runner
decoding, quiet and beside busy loops, under each thread policy.

A child process loads SmolLM2, prefills a batch and decodes for ``--seconds``; while it decodes, ``perf record
-e cpu-clock`` samples all of its threads. The samples are put in these places: OpenMP's runtime (libgomp: a
thread spinning or sleeping at a barrier, or waiting for the next parallel region), kvdoctor's thread pool
(``pool.c``: its threads spinning for work or for their team), torch's kernels (libtorch, MKL, oneDNN),
kvdoctor's C kernels (``~/.cache/kvdoctor/kernels``), the interpreter, and the OS kernel. Beside the
shares: the step's wall time, the CPU time the process took per step (all threads), how much of the wall
time the process ran at all (CPU time / wall time / the kernels' team), and in how many steps the pool slept at
once (the thread policy's answer to the load). A sample is a thread on a CPU: a thread descheduled by a busy loop
leaves no sample, so "libgomp" is the CPU the team burned waiting, not the time it lost.

    .venv/bin/python benchmarks/contention_profile.py [--conditions quiet,loops2] [--policies fixed,adaptive]
        [--batch 1] [--seconds 6] [--spincount N] [--wait-quiet S] [--regions] [--json]

``--spincount N`` starts the child with ``GOMP_SPINCOUNT=N`` (how long libgomp spins at a barrier before it
sleeps, read when the runtime loads).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contention import ROOT, BusyLoops, _loops, others, reading, wait_quiet  # noqa: E402

from kvdoctor.engine.kernels import native  # noqa: E402

_LIBGOMP = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "lib/libgomp.so.1"  # torch's runtime
_CHILD = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
from pairing import prefilled, prompts_of
from kvdoctor.engine.model.model import load_model
from kvdoctor.engine.serving.runner import Runner
batch, seconds = int(sys.argv[2]), float(sys.argv[3])
lm = load_model(None, light=True)
runner = Runner.create(lm.model, tokenizer=lm.tokenizer, device_blocks=512, host_blocks=0)
prompts = prompts_of(lm.tokenizer, [40 + 7 * i for i in range(batch)])
prefilled(runner, prompts, 8).run()
sched = prefilled(runner, prompts, 4000)
print("ready", flush=True)
sys.stdin.readline()
from kvdoctor.engine.kernels import pool
t0, c0, steps, teams, asleep = time.perf_counter(), time.process_time(), 0, [], 0
while time.perf_counter() - t0 < seconds:
    sched.step()
    steps += 1
    teams.append(pool.team())
    asleep += pool.spin_us() == 0
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"steps": steps, "step_ms": 1e3 * wall / steps, "cpu_ms": 1e3 * cpu / steps,
                  "base": runner.threads.base, "team_mean": sum(teams) / len(teams),
                  "sleeping_share": asleep / steps}), flush=True)
"""

# Where a sampled symbol's library puts it: OpenMP's runtime (libgomp), kvdoctor's kernels, torch's, the
# interpreter, the OS.
_KERNELS = "|".join(c.stem for c in (ROOT / "engine/kernels").glob("*.c"))  # built as NAME-KEY.so
_PLACES = [("openmp", re.compile(r"libgomp")), ("kvdoctor pool", re.compile(r"^pool-[0-9a-f]+\.so$")),
           ("kvdoctor kernels", re.compile(rf"^({_KERNELS})-[0-9a-f]+\.so$")),
           ("torch", re.compile(r"libtorch|libc10|mkl|dnnl|sleef|libiomp")),
           ("python", re.compile(r"python|\.cpython-|libffi|_ctypes")), ("os kernel", re.compile(r"kernel"))]


def spin_loops(library: str) -> list[int]:
    """The addresses of ``pause`` instructions in ``library``: every spin-wait loop in libgomp (do_spin, inlined
    in the barrier waits and the team's dock) is a ``pause``, a counter and a compare. torch's wheel ships
    libgomp without its internal symbols, so the loops are found by their instruction instead of by name."""
    try:
        text = subprocess.run(["objdump", "-d", library], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(m.group(1), 16) for m in re.finditer(r"^\s*([0-9a-f]+):\s+f3 90\s+pause", text, re.M)]


def place(dso: str, sym: str, pauses: list[int]) -> str:
    name = next((name for name, pattern in _PLACES if pattern.search(dso)), "other")
    if name == "openmp":
        addr = int(sym, 16) if re.fullmatch(r"0x[0-9a-f]+", sym) else None
        spinning = "do_spin" in sym or "barrier_wait" in sym or (
            addr is not None and any(0 <= addr - p <= 0x18 for p in pauses))
        return "openmp spin" if spinning else "openmp other"
    return name


def shares(report: str, pauses: list[int]) -> tuple[dict[str, float], list[tuple[float, str, str]]]:
    """The samples' shares by place and the top symbols, from ``perf report --sort dso,sym --stdio``."""
    places: dict[str, float] = {}
    symbols = []
    for line in report.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+(\S+)\s+\[[.k]\]\s+(.+?)\s*$", line)
        if m:
            pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
            where = place(dso, sym, pauses)
            places[where] = places.get(where, 0.0) + pct
            symbols.append((pct, dso, sym))
    return {k: round(v, 1) for k, v in sorted(places.items(), key=lambda kv: -kv[1])}, symbols[:12]


def _decode_under_perf(condition: str, policy: str, batch: int, seconds: float, spincount: int | None,
                      perf_args: list[str], data: str, quiet_wait: float = 0.0) -> dict:
    """Run the decode child beside ``condition``'s loops with ``perf record PERF_ARGS`` on it while it decodes;
    the child's figures, the load before and the CPUs others took meanwhile."""
    env = {**os.environ, "KVDOCTOR_THREADS": policy}
    if spincount is not None:
        env["GOMP_SPINCOUNT"] = str(spincount)
    with BusyLoops(_loops(condition)) as loops:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ROOT / "benchmarks"), str(batch), str(seconds)],
                                 cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"the decode child failed ({child.wait()})")
        perf = subprocess.Popen(["perf", "record", "-q", *perf_args, "-o", data, "-p", str(child.pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches to every thread before the child starts decoding
        if quiet_wait:
            wait_quiet(quiet_wait, loops.pids + [child.pid, perf.pid])
        running = loops.pids + [child.pid, perf.pid]
        load, before = os.getloadavg()[0], reading(running)
        child.stdin.write("\n")
        child.stdin.flush()
        result = json.loads(child.stdout.readline())
        busy = others(before, reading(running))
        perf.send_signal(signal.SIGINT)
        perf.wait()
        child.wait()
    return {"condition": condition, "policy": policy, "batch": batch, "spincount": spincount,
            "load_before": round(load, 2), "others_cpus": round(busy, 2), **result}


def profile(condition: str, policy: str, batch: int, seconds: float, spincount: int | None,
            quiet_wait: float = 0.0) -> dict:
    """Where the step's CPU samples fall (``places``), with the step's wall and CPU time."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        r = _decode_under_perf(condition, policy, batch, seconds, spincount, ["-e", "cpu-clock", "-F", "997"], data,
                               quiet_wait)
        report = subprocess.run(["perf", "report", "-i", data, "--sort", "dso,sym", "--stdio", "--no-children"],
                                capture_output=True, text=True).stdout
    places, top = shares(report, spin_loops(str(_LIBGOMP)))
    r["ran_share"] = round(r["cpu_ms"] / r["step_ms"] / r["team_mean"], 2)
    return {**r, "places": places, "top": [f"{p:.1f}% {sym} ({Path(dso).name})" for p, dso, sym in top]}


# a parallel region (ends in a barrier); an explicit barrier in one; a loop of kvdoctor's pool (one its caller
# runs alone too: a loop too small to share, or a second thread's)
_ENTRIES = (("probe_libgomp", "GOMP_parallel"), ("probe_libgomp", "GOMP_barrier"), ("probe_pool", "kvdoctor_parallel"))


def regions(policy: str, batch: int, seconds: float) -> dict:
    """Parallel regions, explicit barriers and pool loops a decode step opens, by the library that opened them:
    uprobes on torch's libgomp and kvdoctor's pool (``perf probe``, removed afterwards), each hit's caller from
    its call chain. Quiet only: a count does not depend on the load."""
    pool = native.pool_library()
    libs = {"probe_libgomp": str(_LIBGOMP), "probe_pool": "" if isinstance(pool, str) else pool._name}
    for group, entry in _ENTRIES:
        if libs[group]:
            subprocess.run(["perf", "probe", "-q", "-x", libs[group], entry], capture_output=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "perf.data")
            events = [a for group, e in _ENTRIES if libs[group] for a in ("-e", f"{group}:{e}")]
            # DWARF unwinding: at libgomp's entry the caller has no frame yet, frame pointers would skip it
            r = _decode_under_perf("quiet", policy, batch, seconds, None, [*events, "--call-graph", "dwarf,2048"], data)
            script = subprocess.run(["perf", "script", "-i", data, "-F", "event,ip,sym,dso"], capture_output=True,
                                    text=True).stdout
    finally:
        for group in libs:
            subprocess.run(["perf", "probe", "-q", "-d", f"{group}:*"], capture_output=True)
    counts: dict[str, float] = {}
    for sample in script.split("\n\n"):
        lines = [ln.strip() for ln in sample.strip().splitlines()]
        if len(lines) < 3:
            continue
        entry = next((e for _, e in _ENTRIES if e in lines[0]), "?")
        caller = re.match(r"[0-9a-f]+\s+(.*?)(?:<[^()]*>)?\s*\(([^()]*)\)$", lines[2])  # frame 1: who called it
        where = f"{Path(caller.group(2)).name.split('-')[0]}:{caller.group(1).split('(')[0]}" if caller else "?"
        counts[f"{entry} from {where}"] = counts.get(f"{entry} from {where}", 0) + 1
    per_step = {k: round(v / r["steps"], 1) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {**r, "per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conditions", default="quiet,loops2")
    ap.add_argument("--policies", default="fixed,adaptive")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--spincount", type=int, default=None)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="once the child is ready, wait up to S seconds for the others' load to drop under 0.3 CPUs")
    ap.add_argument("--regions", action="store_true",
                    help="count the parallel regions, barriers and pool loops of a quiet step instead (uprobes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.regions:
        for policy in args.policies.split(","):
            r = regions(policy, args.batch, args.seconds)
            print(json.dumps(r) if args.json else f"{policy} batch {r['batch']}: {r['step_ms']:.1f} ms a step; per step "
                  + ", ".join(f"{k} {v}" for k, v in r["per_step"].items()), flush=True)
        return 0
    for condition in args.conditions.split(","):
        for policy in args.policies.split(","):
            r = profile(condition, policy, args.batch, args.seconds, args.spincount, args.wait_quiet)
            if args.json:
                print(json.dumps(r), flush=True)
                continue
            print(f"{condition} {policy} batch {r['batch']} (load {r['load_before']}, others {r['others_cpus']} CPUs): "
                  f"{r['step_ms']:.1f} ms a step, "
                  f"{r['cpu_ms']:.1f} ms CPU, kernels' team {r['team_mean']:.2f}, ran {r['ran_share']:.0%} of the time, "
                  f"pool asleep at once in {r['sleeping_share']:.0%} of the steps")
            print("  " + ", ".join(f"{k} {v}%" for k, v in r["places"].items()))
            for line in r["top"][:8]:
                print("    " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
