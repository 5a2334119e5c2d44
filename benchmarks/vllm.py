"""vLLM with kvdoctor's plugin on and off, and kvdoctor's runner against vLLM, on the same prompts.

Run with the vLLM environment (``./kvd vllm-setup`` first):

    .venv-vllm/bin/python benchmarks/vllm.py --pairs 4

One process holds one vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler and the
CPU worker run here, so no inter-process hop favours it); kvdoctor's runner, over the same SmolLM2
weights, runs in a child process of its own, driven over a pipe run by run. In vLLM's process the
runner would inherit vLLM's CPU thread binding and its OpenMP runtime (a second one beside torch's,
so the runner's decode kernel stays off): measured in one process, 0.75x and 0.47x of what it
does alone. Both run in one dtype (``--dtype``, fp32 by default) on the machine's cores. Decode tokens/s leave out each request's
prefill and first token (one step first, then the clock). The plugin comparison attaches and
detaches a ``VllmTracer`` between runs of one engine, in ABBA pairs, so machine load hits both
alike; the figure is the median of per-pair ratios with quartiles. On a shared machine those pairs
scatter by tens of percent, so the plugin's cost is also timed in place: the tracer's own work (its
batch, write/read and step-end records, content keys, the trace writes) by the wall clock around its
entry points, as a share of the same run's time, which load slows alike; and every wrapper the tracer installs
by its own time (its wall time less that of vLLM's method inside it), which counts the hooks around vLLM's
calls too (``hooks_share``). A timed call also counts some of its timer's own time (a microsecond or more when
the machine is loaded): ``hooks_share`` and ``rank_share`` take off the calls times what a timed call of a
function doing nothing counts at the end of the run (``*_timed``: as timed).

The plugin is on as users run it (``KVDOCTOR_TRACE``: every hook it installs is in place); the pairs pause
and resume its tracing. ``--tp 2`` serves a small random Llama (head size 64, 4 heads, 2 KV heads) at tensor
parallel size 2, each worker bound to a core: the plugin then also writes each rank's trace in its worker
process, and the pairs pause those too (``LLM.collective_rpc``); each rank's bookkeeping is timed in place
as a share of the same run. ``--tp 3 --model embedded`` serves SmolLM2 itself (9 heads, 3 KV heads: a KV head
a rank) with three workers on the two cores: a step there does a real model's work, where the random Llama's
two layers make the plugin's per-step cost a larger share. The runner comparison is made at ``--tp 1`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_HERE = os.path.dirname(os.path.abspath(__file__))
# This file is named vllm.py: without its folder on the path, `import vllm` finds vLLM, not itself.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
_spec = importlib.util.spec_from_file_location("_pairing", os.path.join(_HERE, "pairing.py"))
_pairing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pairing)
_clocks, _prompts, _rates, paired, runner_decode = (
    _pairing.clocks, _pairing.prompts_of, _pairing.rates, _pairing.paired, _pairing.runner_decode)


def vllm_decode(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Decode tokens/s (wall, CPU) of vLLM over ``prompts``, after every prompt's first step."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{vllm_decode.calls}-{i}", {"prompt_token_ids": p}, params)
    vllm_decode.calls += 1
    engine.step()  # prefill and first token of every request (the batch fits at once)
    t0 = _clocks()
    while engine.has_unfinished_requests():
        engine.step()
    return _rates(len(prompts) * (new_tokens - 1), t0)


vllm_decode.calls = 0


class Clock:
    """Seconds counted by timers, and the calls that counted them: a timed call counts a little of the timer's own
    time too (a microsecond or more on a loaded machine), which ``own`` takes off, at ``timer_cost`` a call."""

    def __init__(self) -> None:
        self.spent, self.calls = 0.0, 0

    def own(self, nested: bool) -> float:
        return self.spent - self.calls * timer_cost(nested)


def _clocked(fn, clock: Clock, sign: int = 1):
    """``fn``, adding (``sign`` 1, a counted call) or taking away (-1) the wall time of each call to ``clock``."""
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.spent += sign * (time.perf_counter() - t)
            clock.calls += sign > 0

    return call


def timer_cost(nested: bool, n: int = 20000) -> float:
    """What one timed call of a function that does nothing counts, now (seconds): through a wrapper's two
    timers (``nested``, the wrapper's and its host's) or one."""
    clock = Clock()
    fn = _clocked(lambda: None, clock, -1) if nested else (lambda: None)
    fn = _clocked(fn, clock)
    for _ in range(n):
        fn()
    return clock.spent / n


@contextlib.contextmanager
def wrappers_timed(clock: Clock):
    """While a tracer is built, every wrapper its guard installs adds its own time to ``clock``: the wrapper's
    wall time minus that of vLLM's method inside it (a wrapper called inside another's host counts once, as its
    own). So the hooks around every call (the request context per row's ``allocate_slots``, their argument
    lookups) count too, which timing the tracer's entry points leaves out."""
    from kvdoctor.integrations.guard import Guard

    wrap = Guard.wrap

    def timed_wrap(self, original, part, **hooks):
        # the guard reads the host's signature through __wrapped__
        host = functools.wraps(original)(_clocked(original, clock, -1))
        outer = _clocked(wrap(self, host, part, **hooks), clock)
        outer.__wrapped__ = original
        return outer

    Guard.wrap = timed_wrap
    try:
        yield
    finally:
        Guard.wrap = wrap


def tracer_share(llm, tracer, prompts: list[list[int]], new_tokens: int) -> float:
    """Share of a whole traced run (prefill and decode) spent in ``tracer``'s own code. Its entry points
    are timed outermost only (they call one another); what the wrappers do inline around vLLM's calls
    (the request context around each row's ``allocate_slots``, a dict update per block allocated or freed) is
    left out here and counted by ``wrappers_timed``."""
    spent, depth = [0.0], [0]

    def timed(fn):
        def call(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0], t = 1, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t
                depth[0] = 0
        return call

    for name in ("_emit", "_content_keys", "_record_batch", "_end_step", "close"):
        setattr(tracer, name, timed(getattr(tracer, name)))
    t0 = time.perf_counter()
    vllm_decode(llm, prompts, new_tokens)
    return spent[0] / (time.perf_counter() - t0)


def _rank_live(worker, live: bool) -> None:
    """In a worker: pause or resume its rank's tracing (the wrappers stay, as when a trace stops)."""
    trace = worker.model_runner.__dict__.get("_kvdoctor_rank")
    if trace:
        trace.guard.live = live


def _rank_clock(worker, start: bool) -> tuple[float, float]:
    """In a worker: start timing its rank's bookkeeping (every part runs through its guard), or return the
    seconds spent since, as timed and less the timer's own cost."""
    trace = worker.model_runner.__dict__.get("_kvdoctor_rank")
    if not trace:
        return 0.0, 0.0
    if start:
        clock = trace._bench_clock = Clock()
        trace.guard.attempt = _clocked(type(trace.guard).attempt.__get__(trace.guard), clock)
        return 0.0, 0.0
    vars(trace.guard).pop("attempt", None)
    clock = trace.__dict__.pop("_bench_clock", Clock())
    return clock.spent, clock.own(nested=False)


class RunnerProcess:
    """kvdoctor's runner in a child process (this file with ``--serve-runner``): each ``decode`` call runs
    one timed decode there and returns its (wall, CPU) tokens/s, measured in the child."""

    def __init__(self, directory: str, dtype: str) -> None:
        import subprocess

        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-runner", directory,
                                      "--dtype", dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = json.loads(self.proc.stdout.readline())  # the child says it is ready, and how it runs

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        wall, cpu = json.loads(self.proc.stdout.readline())
        return wall, cpu

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve_runner(directory: str, dtype: str) -> int:
    """The child side of ``RunnerProcess``: one JSON request per line in, one (wall, CPU) pair out."""
    from kvdoctor.engine.model.model import load_model
    from kvdoctor.engine.serving.runner import Runner

    lm = load_model(directory, dtype=dtype)
    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, device_blocks=512, host_blocks=0)
    runner_decode(runner, [lm.tokenizer.encode("warm up " * 20)] * 8, [4] * 8)
    info = {"threads": __import__("torch").get_num_threads(), "matvec": runner._lm_head.matvec is not None}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(runner_decode(runner, req["prompts"], [req["new_tokens"]] * len(req["prompts"]))), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--pairs", type=int, default=4, help="ABBA pairs per comparison")
    ap.add_argument("--share-runs", type=int, default=3, help="traced runs timing the plugin's code in place")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights, activations and KV cache of both engines")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel size; above 1 each rank's trace is timed too")
    ap.add_argument("--model", choices=("tiny", "embedded"), default=None,
                    help="at --tp above 1: a small random Llama (tiny, the default) or the embedded SmolLM2")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve-runner", metavar="DIR", help=argparse.SUPPRESS)  # the runner's child process
    args = ap.parse_args(argv)
    if args.serve_runner:
        return serve_runner(args.serve_runner, args.dtype)

    from vllm import LLM

    from transformers import AutoTokenizer

    from kvdoctor.engine.model.model import convert_embedded, tiny_llama_dir
    from kvdoctor.integrations.vllm import VllmTracer

    trace_dir = tempfile.mkdtemp(prefix="kvd-vllm-bench-")
    os.environ["KVDOCTOR_TRACE"] = os.path.join(trace_dir, "plugin.kvtrace")  # the plugin on, as users run it
    runner = None
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(args.tp)))
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with this file's functions
        directory = str(convert_embedded()) if args.model == "embedded" else \
            tiny_llama_dir(os.path.join(trace_dir, "model"))
    else:
        directory = str(convert_embedded())
        runner = RunnerProcess(directory, args.dtype)  # started first, so it binds to nothing vLLM set up
    llm = LLM(model=directory, dtype=args.dtype, enforce_eager=True, max_model_len=1024, block_size=32,
              max_num_seqs=8, enable_prefix_caching=False, seed=0, gpu_memory_utilization=0.2,
              tensor_parallel_size=args.tp)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    batch8 = _prompts(AutoTokenizer.from_pretrained(directory), [24, 40, 56, 72, 88, 104, 120, 136])
    batch1 = [batch8[len(batch8) // 2]]
    N = args.new_tokens

    def ranks(live: bool) -> None:
        if args.tp > 1:
            llm.collective_rpc(_rank_live, args=(live,))

    def traced(prompts, share=False):
        hooks = Clock()
        with wrappers_timed(hooks) if share else contextlib.nullcontext():
            tracer = VllmTracer(scheduler, os.path.join(trace_dir, f"run{vllm_decode.calls}.kvtrace"), engine="vllm")
        ranks(True)
        try:
            if not share:
                return vllm_decode(llm, prompts, N)
            if args.tp > 1:
                llm.collective_rpc(_rank_clock, args=(True,))
            t0 = time.perf_counter()
            ours = tracer_share(llm, tracer, prompts, N)
            wall = time.perf_counter() - t0
            ranks_spent = llm.collective_rpc(_rank_clock, args=(False,)) if args.tp > 1 else [(0.0, 0.0)]
            return (ours, max(own for _, own in ranks_spent) / wall, hooks.own(nested=True) / wall,
                    max(spent for spent, _ in ranks_spent) / wall, hooks.spent / wall)
        finally:
            tracer.detach()
            ranks(False)

    vllm_decode(llm, batch8, 4)  # warm the engine (and start each rank's trace) before timing anything
    if getattr(scheduler, "_kvdoctor", None) is not None:
        scheduler._kvdoctor.detach()  # the plugin's own tracer: each traced run below attaches one afresh
    ranks(False)
    if runner is not None:
        runner.decode(batch8, 4)
    results = {"dtype": args.dtype, "new_tokens": N, "pairs": args.pairs, "tp": args.tp,
               "model": args.model or ("tiny" if args.tp > 1 else "embedded"),
               "threads": __import__("torch").get_num_threads(), "load_before": os.getloadavg()[0]}
    if runner is not None:
        results |= {"runner_threads": runner.info["threads"], "runner_matvec": runner.info["matvec"]}
    for name, prompts in (("batch1", batch1), ("batch8", batch8)):
        plugin = paired(lambda p=prompts: vllm_decode(llm, p, N), lambda p=prompts: traced(p), args.pairs)
        shares = sorted(traced(prompts, share=True) for _ in range(args.share_runs))
        ours, rank, hooks, rank_timed, hooks_timed = (sorted(s[i] for s in shares) for i in range(5))
        results[name] = {"plugin_share": round(_pairing.median(ours), 5),
                         "plugin_share_range": [round(ours[0], 5), round(ours[-1], 5)],
                         "hooks_share": round(_pairing.median(hooks), 5),
                         "hooks_share_range": [round(hooks[0], 5), round(hooks[-1], 5)],
                         "hooks_share_timed": round(_pairing.median(hooks_timed), 5)}
        if args.tp > 1:
            results[name] |= {"rank_share": round(_pairing.median(rank), 5),
                              "rank_share_range": [round(rank[0], 5), round(rank[-1], 5)],
                              "rank_share_timed": round(_pairing.median(rank_timed), 5)}
        results[name] |= {
            clock: {"vllm": plugin[clock]["a"], "vllm_traced": plugin[clock]["b"],
                    "plugin_cost": round(1 - plugin[clock]["ratio"], 4),
                    "plugin_cost_q": [round(1 - plugin[clock]["ratio_q3"], 4), round(1 - plugin[clock]["ratio_q1"], 4)]}
            for clock in ("wall", "cpu")}
        if runner is not None:
            engines = paired(lambda p=prompts: vllm_decode(llm, p, N),
                             lambda p=prompts: runner.decode(p, N), args.pairs)
            for clock in ("wall", "cpu"):
                results[name][clock] |= {"runner": engines[clock]["b"], "runner_vs_vllm": engines[clock]["ratio"],
                                         "runner_vs_vllm_q": [engines[clock]["ratio_q1"], engines[clock]["ratio_q3"]]}
    results["load_after"] = os.getloadavg()[0]
    if runner is not None:
        runner.close()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name in ("batch1", "batch8"):
            r = results[name]["wall"]
            ranks_said = (f"; each rank's {100 * results[name]['rank_share']:.2f}% (worst rank)"
                          if args.tp > 1 else "")
            print(f"{name}: plugin code {100 * results[name]['plugin_share']:.2f}% of the traced run (in place, "
                  f"the engine core's entry points; {100 * results[name]['hooks_share']:.2f}% with every wrapper's "
                  f"own time){ranks_said}")
            versus = f"; kvdoctor runner {r['runner']} tok/s = {r['runner_vs_vllm']:.2f}x vLLM" if runner else ""
            print(f"{name}: vLLM {r['vllm']} tok/s, traced {r['vllm_traced']} (plugin cost {100 * r['plugin_cost']:+.1f}%, "
                  f"quartiles {100 * r['plugin_cost_q'][0]:+.1f}..{100 * r['plugin_cost_q'][1]:+.1f}%){versus}")
        if runner is not None:
            print(f"runner (own process): {results['runner_threads']} threads, decode kernel "
                  f"{'on' if results['runner_matvec'] else 'off (F.linear)'}")
        print(f"tp {args.tp}, dtype {args.dtype}, threads {results['threads']}, "
              f"load {results['load_before']:.1f} -> {results['load_after']:.1f}")
    return 0


if __name__ == "__main__":  # vLLM may spawn helpers: the guard keeps them from rerunning this
    sys.exit(main())
