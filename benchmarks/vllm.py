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
entry points, as a share of the same run's time, which load slows alike.
"""

from __future__ import annotations

import argparse
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


def tracer_share(llm, tracer, prompts: list[list[int]], new_tokens: int) -> float:
    """Share of a whole traced run (prefill and decode) spent in ``tracer``'s own code. Its entry points
    are timed outermost only (they call one another); what the wrappers do inline around vLLM's calls
    (a dict update per block allocated or freed) is left out, a few microseconds a step."""
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
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve-runner", metavar="DIR", help=argparse.SUPPRESS)  # the runner's child process
    args = ap.parse_args(argv)
    if args.serve_runner:
        return serve_runner(args.serve_runner, args.dtype)

    from vllm import LLM

    from transformers import AutoTokenizer

    from kvdoctor.engine.model.model import convert_embedded
    from kvdoctor.integrations.vllm import VllmTracer

    directory = str(convert_embedded())
    runner = RunnerProcess(directory, args.dtype)  # started first, so it binds to nothing vLLM set up
    llm = LLM(model=directory, dtype=args.dtype, enforce_eager=True, max_model_len=1024, block_size=32,
              max_num_seqs=8, enable_prefix_caching=False, seed=0, gpu_memory_utilization=0.2)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    batch8 = _prompts(AutoTokenizer.from_pretrained(directory), [24, 40, 56, 72, 88, 104, 120, 136])
    batch1 = [batch8[len(batch8) // 2]]
    trace_dir = tempfile.mkdtemp(prefix="kvd-vllm-bench-")
    N = args.new_tokens

    def traced(prompts, share=False):
        tracer = VllmTracer(scheduler, os.path.join(trace_dir, f"run{vllm_decode.calls}.kvtrace"), engine="vllm")
        try:
            return tracer_share(llm, tracer, prompts, N) if share else vllm_decode(llm, prompts, N)
        finally:
            tracer.detach()

    vllm_decode(llm, batch8, 4)  # warm both engines before timing anything
    runner.decode(batch8, 4)
    results = {"dtype": args.dtype, "new_tokens": N, "pairs": args.pairs, "threads": __import__("torch").get_num_threads(),
               "runner_threads": runner.info["threads"], "runner_matvec": runner.info["matvec"],
               "load_before": os.getloadavg()[0]}
    for name, prompts in (("batch1", batch1), ("batch8", batch8)):
        plugin = paired(lambda p=prompts: vllm_decode(llm, p, N), lambda p=prompts: traced(p), args.pairs)
        engines = paired(lambda p=prompts: vllm_decode(llm, p, N),
                         lambda p=prompts: runner.decode(p, N), args.pairs)
        shares = sorted(traced(prompts, share=True) for _ in range(args.share_runs))
        results[name] = {"plugin_share": round(_pairing.median(shares), 5),
                         "plugin_share_range": [round(shares[0], 5), round(shares[-1], 5)]}
        results[name] |= {
            clock: {"vllm": plugin[clock]["a"], "vllm_traced": plugin[clock]["b"],
                    "plugin_cost": round(1 - plugin[clock]["ratio"], 4),
                    "plugin_cost_q": [round(1 - plugin[clock]["ratio_q3"], 4), round(1 - plugin[clock]["ratio_q1"], 4)],
                    "runner": engines[clock]["b"], "runner_vs_vllm": engines[clock]["ratio"],
                    "runner_vs_vllm_q": [engines[clock]["ratio_q1"], engines[clock]["ratio_q3"]]}
            for clock in ("wall", "cpu")}
    results["load_after"] = os.getloadavg()[0]
    runner.close()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name in ("batch1", "batch8"):
            r = results[name]["wall"]
            print(f"{name}: plugin code {100 * results[name]['plugin_share']:.2f}% of the traced run (in place)")
            print(f"{name}: vLLM {r['vllm']} tok/s, traced {r['vllm_traced']} (plugin cost {100 * r['plugin_cost']:+.1f}%, "
                  f"quartiles {100 * r['plugin_cost_q'][0]:+.1f}..{100 * r['plugin_cost_q'][1]:+.1f}%); kvdoctor runner "
                  f"{r['runner']} tok/s = {r['runner_vs_vllm']:.2f}x vLLM")
        print(f"runner (own process): {results['runner_threads']} threads, decode kernel "
              f"{'on' if results['runner_matvec'] else 'off (F.linear)'}")
        print(f"dtype {args.dtype}, threads {results['threads']}, load {results['load_before']:.1f} -> {results['load_after']:.1f}")
    return 0


if __name__ == "__main__":  # vLLM may spawn helpers: the guard keeps them from rerunning this
    sys.exit(main())
