"""Offline vLLM on the embedded SmolLM2, shaped to exercise every path of its KV cache manager.

Twelve chat requests share one system prompt (prefix-cache hits after the first), the KV cache
is cut to a few dozen blocks with ``num_gpu_blocks_override`` so vLLM must preempt running
requests to make room, and two requests are aborted mid-generation. Run it under the doctor:

    kvdoctor check -- .venv-vllm/bin/python examples/vllm_offline.py
    kvdoctor watch -- .venv-vllm/bin/python examples/vllm_offline.py

``--blocks``, ``--requests`` and ``--max-tokens`` size it; the model directory is the converted
SmolLM2 in ``~/.cache/kvdoctor/models`` unless ``--model`` names another.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

SYSTEM = (
    "You are a careful assistant for people who run language models in production. You answer in two "
    "or three short sentences, you name the component you are talking about, and when you are unsure "
    "you say so plainly instead of guessing. You never invent numbers. When a question is about memory, "
    "you say which memory: the accelerator's, the host's or the disk's, and which part of the server holds it: "
    "the weights, the activations or the KV cache. When a question is about speed, you say whether it is about "
    "the time to the first token or the time between tokens, since the two have different causes."
)
QUESTIONS = [
    "What is a KV cache?", "Why do long prompts use more memory?", "What does paging the cache buy?",
    "When should a server preempt a request?", "What is prefix caching?", "How big is one cache block?",
    "Why quantize keys and values?", "What is continuous batching?", "Why do leaks appear on host memory?",
    "What is a stale cache version?", "How do I read a flame graph?", "What is speculative decoding?",
]


def _default_model() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    found = sorted(glob.glob(os.path.join(base, "kvdoctor", "models", "SmolLM2-135M-Instruct-*")))
    if not found:
        sys.exit("vllm_offline: no converted SmolLM2 under ~/.cache/kvdoctor/models: run ./kvd doctor --convert first")
    return found[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--blocks", type=int, default=24, help="KV cache blocks of 32 tokens (small: forces preemption)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--aborts", type=int, default=2, help="requests aborted after a few steps")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model or _default_model(), dtype="float32", enforce_eager=True, max_model_len=512, block_size=32,
              num_gpu_blocks_override=args.blocks, enable_prefix_caching=True, max_num_seqs=8, seed=0,
              gpu_memory_utilization=0.2)  # on CPU: the share of host memory vLLM checks is free at start
    tokenizer = llm.get_tokenizer()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        prompt = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                                               tokenize=False, add_generation_prompt=True)
        engine.add_request(f"req-{i}", prompt, params)
    aborted = [f"req-{i}" for i in range(1, 1 + 2 * args.aborts, 2)][: args.aborts]
    steps = finished = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
        steps += 1
        if steps == 6 and aborted:
            engine.abort_request(aborted)
    print(f"vllm_offline: {finished} requests finished, {len(aborted)} aborted, {steps} steps")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from rerunning this
    main()
