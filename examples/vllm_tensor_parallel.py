"""vLLM at tensor parallel size 2 under the plugin: the engine core and each rank write a trace, checked as one.

A small random Llama (seed 0; head size 64, 4 heads and 2 KV heads, so each rank holds one KV head) serves
chat requests that share a system prompt (prefix-cache hits) on a few dozen blocks. Each worker is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``, default ``0|1``). Under
the doctor, the engine core's trace and each rank's are read as one workload; the ranks must agree step by
step (``ranks/*``):

    kvdoctor check -- .venv-vllm/bin/python examples/vllm_tensor_parallel.py
    KVDOCTOR_TRACE=/tmp/tp/run.kvtrace .venv-vllm/bin/python examples/vllm_tensor_parallel.py
    kvdoctor watch --trace /tmp/tp            # t / T: the engine core, rank 0, rank 1

About a minute on 2 cores, most of it vLLM's start-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile

SYSTEM = ("You are a careful assistant for people who run language models in production. You answer in two or "
          "three short sentences and say plainly when you are unsure.")
QUESTIONS = ["What is a KV cache?", "Why do long prompts use more memory?", "What is prefix caching?",
             "When should a server preempt a request?", "What is continuous batching?", "Why quantize the cache?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=32, help="KV cache blocks of 32 tokens")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    from kvdoctor.engine.model.model import tiny_llama_dir

    llm = LLM(model=tiny_llama_dir(tempfile.mkdtemp(prefix="kvdoctor-tiny-llama-")), dtype="float32",
              enforce_eager=True, max_model_len=512, block_size=32, num_gpu_blocks_override=args.blocks,
              enable_prefix_caching=True, tensor_parallel_size=2, max_num_seqs=4, seed=0)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             tokenize=False, add_generation_prompt=True) for i in range(args.requests)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    print(f"vllm_tensor_parallel: {len(outputs)} requests served at TP=2, "
          f"{sum(len(o.outputs[0].token_ids) for o in outputs)} tokens")

if __name__ == "__main__":  # vLLM spawns its engine core and workers: the guard keeps them from rerunning this
    main()
