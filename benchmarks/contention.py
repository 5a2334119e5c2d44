"""The engine beside other work: how much slower it runs when other processes want its CPUs, against a fair share.

Each workload runs as a child process, quiet and beside competitors: ``k`` single-threaded busy loops, or a
second copy of itself at the same time (two OpenMP processes, each with a full team: "omp"). A fair share
of ``C`` CPUs beside ``k`` busy loops costs ``(C + k) / C`` (the workload's ``C`` threads and the loops
share the CPUs equally); beside a copy of itself, 2. Workloads:

- ``serve``: ``examples/serve.py --requests 12 --device-blocks 10 --host-blocks 2 --disk-blocks 256`` (continuous
  batching with swaps to host and disk), its own elapsed time;
- ``decode``: ``kvdoctor run`` greedy decode at batch 1, the time per decode token;
- ``decode8``: the runner (``Runner.forward`` under the scheduler, as ``kvdoctor run`` drives it) decoding eight
  requests in one batch (``benchmarks/decode.py``'s batch-8 prompt lengths), the time per decode step (8 tokens);
- ``demo``: ``kvdoctor check --demo --steps`` (``--tokens``) from start to exit: model load, the demo's engine on
  SmolLM2 and the checks; two at once ("omp") is the issue's "two kvdoctor demos at once";
- ``generate``: transformers' ``generate`` on the same model at batch 1, the time per decode token (the
  reference: what a plain torch workload loses);
- ``generate+policy``: the same ``generate`` with the thread policy asked before every forward pass (a forward
  pre-hook calling ``ThreadPolicy.before_step``): what the policy would give transformers' path (``EngineCache``);
- ``tui`` (``--tui``): ``kvdoctor watch --demo``'s app in this process (headless, Textual's Pilot) over the demo
  on SmolLM2 in its child, beside the same competitors: the seconds from a key press (pause, twice a second)
  to the app having handled it and gone idle, median and worst of ``--presses``; the goal is 0.2 s.

kvdoctor's workloads run under each thread policy (``KVDOCTOR_THREADS``: ``adaptive``, the default, puts the
kernels' pool to sleep at once while others want the CPUs and shrinks torch's team; ``fixed`` keeps both as they
start; either may add OpenMP settings: ``policy_env``). A policy named ``old:POLICY`` runs its workload from
the checkout ``--old`` names instead (``git worktree add /tmp/old COMMIT``: the code before a change, e.g. its
kernels on torch's OpenMP threads), with this process's environment otherwise. Every
(condition, policy, workload) runs once per repeat, in the same order each repeat, so a drift in the machine's
load hits them alike; the report is
the median over repeats of each time and its ratio to the same policy's quiet time. Beside every run: the
load average before it and the CPUs' worth of time processes other than the benchmark's took during it
("others' CPUs", from ``/proc/stat`` less the benchmark's own, its workloads' and its loops' CPU time): on a shared
machine, a run with others above ~0.3 ran beside more than its condition says. For decode and decode8, also how
often the thread policy changed the team's size in the run ("team changes"). Usage::

    .venv/bin/python benchmarks/contention.py [--repeats 3] [--conditions quiet,loops1,loops2,loops4,omp]
        [--workloads serve,decode,decode8,demo,generate,generate+policy] [--policies adaptive,fixed] [--tokens 64]
        [--old TREE] [--wait-quiet S] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvdoctor.engine.model.threads import cpu_busy

ROOT = Path(__file__).resolve().parents[1]
CPUS = set(os.sched_getaffinity(0))
PROMPT = "The history of computing is a story of layers: transistors make gates, and gates make"
_GENERATE = """
import sys, time, torch
from kvdoctor.engine.model.model import load_model
lm = load_model(None)
ids = torch.tensor([lm.tokenizer.encode(sys.argv[1])])
n = int(sys.argv[2])
marks = []
def note(input_ids, scores):
    marks.append(time.perf_counter())
    return scores
if sys.argv[3] == "policy":
    from kvdoctor.engine.model.threads import ThreadPolicy
    policy = ThreadPolicy(adaptive=True)
    def size_team(module, args):
        policy.before_step()  # returns None: the pass's inputs stay
    lm.model.register_forward_pre_hook(size_team)
lm.model.generate(ids, max_new_tokens=4, do_sample=False)
lm.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, logits_processor=[note])
print((marks[-1] - marks[0]) / (len(marks) - 1))
"""
_BATCH = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pairing import prefilled, prompts_of
from kvdoctor.engine.model.model import load_model
from kvdoctor.engine.serving.runner import Runner
lm = load_model(None, light=True)
runner = Runner.create(lm.model, tokenizer=lm.tokenizer, device_blocks=512, host_blocks=0)
prompts = prompts_of(lm.tokenizer, [24, 40, 56, 72, 88, 104, 120, 136])
n = int(sys.argv[2])
prefilled(runner, prompts, 4).run()
sched = prefilled(runner, prompts, n)
t0 = time.perf_counter()
sched.run()
print((time.perf_counter() - t0) / (n - 1), runner.threads.changes)
"""


def _command(workload: str, tokens: int, root: Path) -> list[str]:
    py = sys.executable
    if workload == "serve":
        return [py, str(root / "examples/serve.py"), "--requests", "12", "--device-blocks", "10", "--host-blocks", "2",
                "--disk-blocks", "256"]
    if workload == "decode":
        return [py, "-m", "kvdoctor.cli", "run", "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--greedy", "--json",
                "--no-probes"]
    if workload == "decode8":
        return [py, "-c", _BATCH, str(root / "benchmarks"), str(tokens)]
    if workload == "demo":
        return [py, "-m", "kvdoctor.cli", "check", "--demo", "--steps", str(tokens)]
    return [py, "-c", _GENERATE, PROMPT, str(tokens), "policy" if workload == "generate+policy" else "-"]


def _seconds(workload: str, proc: subprocess.CompletedProcess[str], wall: float) -> tuple[float, int | None]:
    """The workload's own figure: the serve example's elapsed seconds; the demo's whole run (``wall``, model load
    and checks included, as its user waits for it); seconds per decode step otherwise. Beside it, how often the
    thread policy changed the team's size (decode and decode8; None where the workload does not say): a quiet
    run whose team moved was not quiet to the policy."""
    if proc.returncode != 0:
        raise SystemExit(f"{workload} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    if workload == "demo":
        return wall, None
    if workload == "serve":
        return float(re.search(r"tokens in \d+ steps, ([0-9.]+) s", proc.stderr).group(1)), None
    last = proc.stdout.strip().splitlines()[-1]
    if workload == "decode":
        result = json.loads(last)
        return 1.0 / result["decode_tokens_per_s"], result["threads"]["changes"]
    seconds, *changes = last.split()
    return float(seconds), int(changes[0]) if changes else None


def policy_env(policy: str) -> dict[str, str]:
    """The environment of a policy: ``adaptive`` or ``fixed`` (``KVDOCTOR_THREADS``), then any ``+VAR=VALUE``
    the workload starts with (``fixed+OMP_WAIT_POLICY=PASSIVE``, ``fixed+OMP_NUM_THREADS=1``: the static
    settings; ``adaptive+GOMP_SPINCOUNT=10000``: a bounded spin)."""
    threads, *settings = policy.split("+")
    return {"KVDOCTOR_THREADS": threads, **dict(s.split("=", 1) for s in settings)}


# Imports kvdoctor from another checkout: its package mapping (pip's editable finder, loaded before this runs)
# pointed at that tree
_OLD_TREE = """
import sys
root = {root!r}
for name, module in list(sys.modules.items()):
    if name.startswith("__editable___kvdoctor") and isinstance(getattr(module, "MAPPING", None), dict):
        module.MAPPING.update({{"kvdoctor": root + "/kvdoctor", "kvdoctor.checks": root + "/checks",
                               "kvdoctor.engine": root + "/engine"}})
"""


def _tree_env(root: Path, shims: Path) -> dict[str, str]:
    """The environment that makes a child import kvdoctor from ``root`` (a ``sitecustomize`` under ``shims``)."""
    shim = shims / "old"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_OLD_TREE.format(root=str(root)))
    return {"PYTHONPATH": str(shim)}


def _run(workload: str, tokens: int, policy: str, copies: int, old: Path | None, shims: Path
         ) -> tuple[float, int | None]:
    """Mean figure of ``copies`` instances of the workload started together, and the most team changes of one."""
    root = ROOT
    if policy.startswith("old:"):
        if old is None:
            raise SystemExit(f"policy {policy} needs --old TREE")
        root, policy = old, policy.removeprefix("old:")
    env = {**os.environ, **policy_env(policy), **(_tree_env(root, shims) if root != ROOT else {})}
    t0 = time.perf_counter()
    procs = [subprocess.Popen(_command(workload, tokens, root), env=env, cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(copies)]

    def finish(p: subprocess.Popen[str]) -> tuple[float, int | None]:  # each copy's own end, in any order
        out, err = p.communicate()
        return _seconds(workload, subprocess.CompletedProcess(p.args, p.returncode, out, err), time.perf_counter() - t0)

    with ThreadPoolExecutor(copies) as pool:
        ends = list(pool.map(finish, procs))
    changes = [c for _, c in ends if c is not None]
    return statistics.fmean(x for x, _ in ends), max(changes) if changes else None


def proc_cpu(pids: list[int]) -> float:
    """Seconds the running processes ``pids`` have run so far (a child's time reaches ``os.times`` only once it
    is waited for)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def reading(running: list[int]) -> tuple[float, float, float]:
    """(now, CPU seconds every process has run on this machine's CPUs, CPU seconds the benchmark's own processes
    have run: itself, its finished children and the children still ``running``)."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system + proc_cpu(running)
    return time.monotonic(), cpu_busy(CPUS) or 0.0, own


def others(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """CPUs' worth of time processes other than the benchmark's took between two readings: the machine's noise
    beside a figure (the other engineers' work on a shared machine), 0 on a machine left to the benchmark."""
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def wait_quiet(most: float, running: list[int], limit: float = 0.3) -> float:
    """Wait (up to ``most`` seconds) until processes other than the benchmark's take under ``limit`` CPUs over
    two seconds: on a shared machine a run then starts in a quiet moment. The last window's reading."""
    deadline = time.monotonic() + most
    while True:
        before = reading(running)
        time.sleep(2.0)
        busy = others(before, reading(running))
        if busy < limit or time.monotonic() >= deadline:
            return busy


def _loops(condition: str) -> int:
    """The busy loops a condition runs beside: ``loops2`` two; ``quiet`` and ``omp`` none."""
    return int(condition.removeprefix("loops")) if condition.startswith("loops") else 0


# A busy loop that ends with its parent, however the parent ends (a benchmark killed mid-run leaves no spinner)
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(1_000_000): pass"


class BusyLoops:
    """``n`` single-threaded processes that spin for as long as the block runs."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyLoops:
        self.procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(self.n)]
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


async def _key_latency(presses: int) -> list[float]:
    from kvdoctor.tui.app import KvdoctorApp
    from kvdoctor.tui.feed import LiveFeed
    from kvdoctor.tui.workload import Workload

    with tempfile.TemporaryDirectory() as workdir:
        workload = Workload.demo(seconds=600, workdir=workdir)
        app = KvdoctorApp(lambda publish: LiveFeed(str(workload.trace), publish, workload=workload, wait_s=600),
                          workload=workload, show_pid=False)
        waits: list[float] = []
        try:
            async with app.run_test(size=(120, 36)) as pilot:
                deadline = time.monotonic() + 300
                while (app.snapshot is None or app.snapshot.step < 3) and time.monotonic() < deadline:
                    await pilot.pause(0.2)  # the model loads and the demo's first steps run
                for _ in range(presses):
                    before = app.paused
                    t0 = time.perf_counter()
                    await pilot.press("p")
                    assert app.paused != before
                    waits.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.5)
                await pilot.press("q")
        finally:
            workload.stop()
    return waits


def tui_latency(condition: str, presses: int) -> dict[str, float]:
    with BusyLoops(_loops(condition)):
        waits = asyncio.run(_key_latency(presses))
    return {"median": round(statistics.median(waits), 4), "worst": round(max(waits), 4)}


def fair_share(condition: str, cpus: int) -> float:
    """What the condition should cost a workload with one thread a CPU, if every runnable thread got its share."""
    if condition == "omp":
        return 2.0
    return max(1.0, (cpus + _loops(condition)) / cpus)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conditions", default="quiet,loops1,loops2,loops4,omp")
    ap.add_argument("--workloads", default="serve,decode,generate")
    ap.add_argument("--policies", default="adaptive,fixed")
    ap.add_argument("--tokens", type=int, default=64,
                    help="decode tokens of the decode and generate workloads; the demo's steps")
    ap.add_argument("--tui", action="store_true", help="also the TUI's key latency beside each condition but omp")
    ap.add_argument("--presses", type=int, default=20)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each run, wait up to S seconds for the others' load to drop under 0.3 CPUs")
    ap.add_argument("--old", type=Path, metavar="TREE",
                    help="a checkout of earlier code, which policies named old:POLICY run their workloads from")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shims = tempfile.TemporaryDirectory(prefix="contention-")  # old:POLICY's sitecustomize; gone at exit
    conditions, workloads, policies = (s.split(",") for s in (args.conditions, args.workloads, args.policies))
    cpus = len(CPUS)
    runs: dict[tuple[str, str, str], list[float]] = {}
    noise: dict[tuple[str, str, str], list[tuple[float, float, int | None]]] = {}  # load before, others', changes
    for _ in range(args.repeats):
        for condition in conditions:
            with BusyLoops(_loops(condition)) as loops:
                for workload in workloads:
                    for policy in (policies if not workload.startswith("generate") else ["-"]):
                        copies = 2 if condition == "omp" else 1
                        if args.wait_quiet:
                            wait_quiet(args.wait_quiet, loops.pids)
                        load, before = os.getloadavg()[0], reading(loops.pids)
                        x, changes = _run(workload, args.tokens, policy if policy != "-" else "fixed", copies,
                                          args.old, Path(shims.name))
                        busy = others(before, reading(loops.pids))
                        runs.setdefault((workload, policy, condition), []).append(x)
                        noise.setdefault((workload, policy, condition), []).append((load, busy, changes))
                        print(f"{workload} {policy} {condition}: {x:.4f} (load {load:.2f}, others {busy:.2f} CPUs, "
                              f"team changes {changes})", file=sys.stderr, flush=True)
    rows = []
    for (workload, policy, condition), xs in runs.items():
        quiet = runs.get((workload, policy, "quiet"))
        t = statistics.median(xs)
        ratio = t / statistics.median(quiet) if quiet else None
        rows.append({"workload": workload, "policy": policy, "condition": condition, "seconds": round(t, 4),
                     "ratio": None if ratio is None else round(ratio, 2), "fair": round(fair_share(condition, cpus), 2),
                     "runs": [round(x, 4) for x in xs],
                     "load": [round(n[0], 2) for n in noise[(workload, policy, condition)]],
                     "others_cpus": [round(n[1], 2) for n in noise[(workload, policy, condition)]],
                     "team_changes": [n[2] for n in noise[(workload, policy, condition)]]})
    keys = {c: tui_latency(c, args.presses) for c in conditions if c != "omp"} if args.tui else {}
    if args.json:
        print(json.dumps({"cpus": cpus, "rows": rows, "tui_key_seconds": keys}))
    else:
        wide = max([9] + [len(r["policy"]) for r in rows])
        print(f"{'workload':15} {'policy':{wide}} {'condition':9} {'median':>9} {'× quiet':>8} {'fair':>5}  others' CPUs")
        for r in rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
            print(f"{r['workload']:15} {r['policy']:{wide}} {r['condition']:9} {r['seconds']:9.4f} {ratio:>8} "
                  f"{r['fair']:5.2f}  "
                  + " ".join(f"{x:.2f}" for x in r["others_cpus"]))
        for condition, k in keys.items():
            print(f"tui key latency beside {condition}: median {k['median']:.3f} s, worst {k['worst']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
