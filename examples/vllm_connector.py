"""vLLM with a KV connector on the embedded SmolLM2: K/V saved to shared storage, then loaded back.

vLLM's ``ExampleConnector`` writes each prompt's K/V per layer to files under a directory and, for a
later request whose prompt it finds there, injects it into the paged cache instead of computing it:
the path disaggregated prefill takes from one instance to the next. The first pass saves, the second
loads (vLLM logs "Inject KV cache of N tokens"); finished requests hand their blocks to the connector
before vLLM frees them. Under the doctor a clean run gives no finding:

    kvdoctor check -- .venv-vllm/bin/python examples/vllm_connector.py
"""

from __future__ import annotations

import argparse
import tempfile

from vllm_offline import QUESTIONS, SYSTEM, _default_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--storage", default=None, help="the connector's directory (default: a new temporary one)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    storage = args.storage or tempfile.mkdtemp(prefix="kvdoctor-kv-connector-")
    llm = LLM(model=args.model or _default_model(), dtype="float32", enforce_eager=True, max_model_len=512,
              block_size=32, num_gpu_blocks_override=64, enable_prefix_caching=False, max_num_seqs=4, seed=0,
              gpu_memory_utilization=0.2,
              kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                  kv_connector_extra_config={"shared_storage_path": storage}))
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                             tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS[:args.requests]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)  # computes and saves every prompt's K/V
    second = llm.generate(prompts, params, use_tqdm=False)  # loads them back from the connector's files
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(first, second))
    print(f"vllm_connector: {len(second)} requests saved then loaded through {storage}; {same} gave the same tokens")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from rerunning this
    main()
