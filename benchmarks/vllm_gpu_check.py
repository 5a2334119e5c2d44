"""vLLM on a GPU under kvdoctor's plugin: one short run that installs nothing, checks the trace and prints the cost.

On a machine with an NVIDIA GPU and a vLLM environment already there (``./kvd vllm-setup`` where
``nvidia-smi`` exists installs the ``vllm`` CUDA wheel; or ``./kvd vllm-setup-033``):

    .venv-vllm/bin/python benchmarks/vllm_gpu_check.py            # a few minutes
    .venv-vllm/bin/python benchmarks/vllm_gpu_check.py --pairs 3 --json

SmolLM2 (the embedded model, converted once) serves requests that share a system prompt, with prefix
caching on, a pool cut to a few dozen blocks so vLLM must preempt, and vLLM's CPU-offloading connector
(``OffloadingConnector``) storing blocks to host memory and loading them back on hits. Each run is a
child process (vLLM's engine core where users have it); the traced runs set ``KVDOCTOR_TRACE`` so the
plugin loads as in production. Runs alternate untraced/traced (ABBA); the overhead is the median of the
per-pair ratios of wall time. Every trace is judged by every check: a clean run must give no finding.
The exit status is the number of failed sections (a finding, a crash, an overhead above ``--goal``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = ("You are a careful assistant for people who run language models in production. You answer in two or "
          "three short sentences and say plainly when you are unsure. ") * 3
QUESTIONS = ["What is a KV cache?", "Why do long prompts use more memory?", "What is prefix caching?",
             "When should a server preempt a request?", "What is continuous batching?", "Why quantize the cache?",
             "What is a stale cache version?", "What is speculative decoding?"]


def workload(model: str, requests: int, max_tokens: int, blocks: int) -> None:
    """The served workload (in the child): two rounds, so the second hits the prefix cache and the offload."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, block_size=16, enable_prefix_caching=True,
              num_gpu_blocks_override=blocks, max_num_seqs=16, seed=0, gpu_memory_utilization=0.3,
              kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                  kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30}))
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
                                       tokenize=False, add_generation_prompt=True) for i in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for _ in range(2):
        llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def run(args: argparse.Namespace, trace: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"}
    if trace:
        env["KVDOCTOR_TRACE"] = trace
    out = subprocess.run([sys.executable, __file__, "--child", args.model, str(args.requests), str(args.max_tokens),
                          str(args.blocks)], env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the workload failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def judge(trace: str) -> tuple[list, int]:
    from kvdoctor.checks import make_suite
    from kvdoctor.trace import TraceReader

    suite = make_suite()
    findings = suite.observe_many(TraceReader(trace))
    return findings + suite.finish(), suite.num_events


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a local model directory (default: the converted SmolLM2)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=96, help="GPU KV blocks of 16 tokens (few: preemption)")
    ap.add_argument("--pairs", type=int, default=2, help="ABBA pairs of untraced/traced runs")
    ap.add_argument("--goal", type=float, default=1.03, help="the largest traced/untraced time ratio accepted")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, requests, max_tokens, blocks = args.child
        workload(model, int(requests), int(max_tokens), int(blocks))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("vllm_gpu_check: no CUDA device here; this check needs a GPU", file=sys.stderr)
        return 2
    if args.model is None:
        from kvdoctor.engine.model.model import convert_embedded

        args.model = str(convert_embedded())
    import vllm

    failures: list[str] = []
    ratios, found, events = [], [], 0
    with tempfile.TemporaryDirectory(prefix="kvdoctor-vllm-gpu-") as tmp:
        for pair in range(args.pairs):
            traces = [str(Path(tmp) / f"p{pair}-{i}.kvtrace") for i in range(2)]
            plain_a, traced_a = run(args, None), run(args, traces[0])
            traced_b, plain_b = run(args, traces[1]), run(args, None)
            ratios.append((traced_a + traced_b) / (plain_a + plain_b))
            for trace in traces:
                f, n = judge(trace)
                found += f
                events += n
    overhead = statistics.median(ratios)
    if found:
        failures.append(f"{len(found)} findings on clean runs")
    if overhead > args.goal:
        failures.append(f"plugin overhead {overhead:.3f}x above the goal {args.goal}x")
    result = {"gpu": torch.cuda.get_device_name(0), "vllm": vllm.__version__, "pairs": args.pairs,
              "overhead_median": round(overhead, 4), "ratios": [round(r, 4) for r in ratios], "events": events,
              "findings": [f"{f.check}/{f.rule}: {f.message}" for f in found[:10]], "failures": failures}
    print(json.dumps(result, indent=None if args.json else 1))
    return len(failures)


if __name__ == "__main__":
    sys.exit(main())
