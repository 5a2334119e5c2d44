"""Disaggregated prefill and decode on the embedded SmolLM2: one vLLM instance computes the prompts' K/V and
saves it through a KV connector, a second instance loads it and decodes. Checked as one workload:

    kvdoctor check -- .venv-vllm/bin/python examples/vllm_disaggregated.py             # clean: no finding
    kvdoctor check -- .venv-vllm/bin/python examples/vllm_disaggregated.py --fault foreign-kv

Both instances use vLLM's ``ExampleConnector`` over one shared directory (one file per layer under a folder
named by a hash of the prompt's tokens), the way a prefill server hands a request to a decode server. Each
instance's engine core writes its own trace (``workload.kvtrace``, ``workload.2.kvtrace``), tagged with its
instance (``prefill``, ``decode``); the plugin records each save and load with the connector's key and a
digest per block of the K/V on each side, and ``kvdoctor check`` pairs them (``handoff`` rules).

``--fault foreign-kv`` overwrites, between the two instances, one prompt's files in the store with another
prompt's K/V of the same length: the decode instance loads K/V that is not its prompt's, and the check names
the instance, the request and the block (``handoff/digest-mismatch``). ``--fault block-size`` starts the
decode instance with blocks of 64 tokens where the prefill used 32: the same K/V lands in blocks of another
size (``handoff/layout-mismatch``, vLLM #30358).

``--tp 2`` runs both instances at tensor parallel size 2 on a small random Llama (each rank holds one KV head):
each worker then writes its rank's trace and its connector's, and each rank's load pairs with the same rank's
save. vLLM's ``ExampleConnector`` names a layer's file by the prompt alone, not by the rank, so with
``--store shared`` both ranks of the prefill instance write their heads to one file and the decode instance's
ranks load whichever landed (a race, layer by layer): ``kvdoctor check`` names every request one of whose ranks
loaded the other rank's heads (``handoff/digest-mismatch``, which says so). The default at TP above 1,
``--store per-rank``, gives each rank a folder of its own (``vllm_rank_store.RankedExampleConnector``): clean.
``--fault ranks`` (TP 2) bends rank 1's connectors, a request each: the prefill rank saves nothing for the first
request it stores (``handoff/save-missing``, LMCache #1807) and every layer but layer 1 for the second
(``handoff/save-layers``); those entries are incomplete, so the decode instance computes both prompts itself;
the decode rank loads every layer but the last for the first request it loads (``handoff/partial-load``). Each
is named with the instance, rank, request and block; the fourth request stays clean.
``--fault overwrite`` (TP 2) changes a row of the first prompt's first block on the prefill's rank 1, at layer 1,
after the forward pass wrote it and before its connector saves it (a block reused or overwritten before its
save); the ranks digest their writes (``KVDOCTOR_VLLM_RANK_DIGESTS=1``, set by the fault), and the check names
the instance, rank, request, block and layer (``integrity/read-mismatch`` in that rank's trace). A clean run with
``KVDOCTOR_VLLM_RANK_DIGESTS=1`` finds nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile

from vllm_offline import QUESTIONS, SYSTEM, _default_model

_BLOCK = 32


def instance(name: str, model: str, storage: str, block_size: int = _BLOCK, tp: int = 1, per_rank: bool = False):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    connector = dict(kv_connector="RankedExampleConnector", kv_connector_module_path="vllm_rank_store") \
        if per_rank else dict(kv_connector="ExampleConnector")
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, block_size=block_size,
               num_gpu_blocks_override=64, enable_prefix_caching=False, max_num_seqs=4, seed=0,
               gpu_memory_utilization=0.2, tensor_parallel_size=tp,
               kv_transfer_config=KVTransferConfig(**connector, kv_role="kv_both", engine_id=name,
                                                   kv_connector_extra_config={"shared_storage_path": storage}))


def overwrite_one(storage: str, before: set[str]) -> str:
    """The fault: one prompt's folder in the store gets another prompt's files of the same shapes."""
    import safetensors.torch

    folders = sorted(set(os.listdir(storage)) - before)

    def shapes(folder: str) -> tuple:
        files = sorted(os.listdir(os.path.join(storage, folder)))
        return tuple((f, tuple(safetensors.torch.load_file(os.path.join(storage, folder, f))["kv_cache"].shape))
                     for f in files[:1]) + (len(files),)

    by_shape: dict[tuple, list[str]] = {}
    for folder in folders:
        by_shape.setdefault(shapes(folder), []).append(folder)
    pair = next((names for names in by_shape.values() if len(names) > 1), None)
    if pair is None:
        raise SystemExit("vllm_disaggregated: no two prompts of the same length to swap; use more --requests")
    victim, other = pair[0], pair[1]
    for f in os.listdir(os.path.join(storage, other)):
        shutil.copyfile(os.path.join(storage, other, f), os.path.join(storage, victim, f))
    return victim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--fault", choices=["foreign-kv", "block-size", "ranks", "overwrite"],
                    help="foreign-kv: overwrite a prompt's K/V in the store with another's; block-size: the decode "
                    "instance pages its cache in blocks of 64 tokens where the prefill used 32; ranks (--tp 2): rank 1's "
                    "connectors save nothing, then all but layer 1, and (decode) load all but the last layer, a "
                    "request each; overwrite (--tp 2): prefill rank 1 changes a block at layer 1 before saving it")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of both instances (2: a small random "
                    "Llama with an even head count, each worker bound to a core)")
    ap.add_argument("--store", choices=["shared", "per-rank"], default=None,
                    help="shared: vLLM's ExampleConnector (every rank writes the same files); per-rank: a folder per "
                    "rank (default at --tp above 1)")
    args = ap.parse_args()
    per_rank = (args.store or ("per-rank" if args.tp > 1 else "shared")) == "per-rank"
    if args.fault in ("ranks", "overwrite") and args.tp < 2:
        ap.error(f"--fault {args.fault} acts on rank 1: use --tp 2")

    from vllm import SamplingParams

    import vllm_rank_store

    if args.fault in ("ranks", "overwrite"):  # the faults travel to the workers as functions of vllm_rank_store
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.fault == "overwrite":  # seen only where the ranks digest what they write
        os.environ.setdefault("KVDOCTOR_VLLM_RANK_DIGESTS", "1")
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % 2) for i in range(args.tp)))
        from kvdoctor.engine.model.model import tiny_llama_dir

        model = args.model or tiny_llama_dir(tempfile.mkdtemp(prefix="kvdoctor-tiny-llama-"))
    else:
        model = args.model or _default_model()
    storage = tempfile.mkdtemp(prefix="kvdoctor-disaggregated-")
    prefill = instance("prefill", model, storage, tp=args.tp, per_rank=per_rank)
    if args.fault == "ranks":  # rank 1 saves nothing of the first request it stores, all but layer 1 of the second
        prefill.collective_rpc(vllm_rank_store.skip_saves, args=(1, [None, 1]))
    if args.fault == "overwrite":
        prefill.collective_rpc(vllm_rank_store.overwrite_before_save, args=(1, 1))
    tokenizer = prefill.get_tokenizer()
    # the question first: the connector keys a prompt by its tokens up to a block boundary, so prompts that
    # differ only after a long shared system prompt would share one entry in the store
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{q}\n\nHow to answer: {SYSTEM}"}],
                                             tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS[:args.requests]]
    # the prefill instance computes each prompt (and one token) and saves its K/V to the store
    prefill.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    del prefill
    gc.collect()  # its engine core exits and closes its trace
    if args.fault == "foreign-kv":
        print(f"vllm_disaggregated: fault foreign-kv: store entry {overwrite_one(storage, set())[:12]}… now holds "
              "another prompt's K/V")
    # the decode instance finds each prompt's K/V in the store, loads it and decodes
    decode = instance("decode", model, storage, block_size=2 * _BLOCK if args.fault == "block-size" else _BLOCK,
                      tp=args.tp, per_rank=per_rank)
    if args.fault == "ranks":  # rank 1 loads all but the last layer of the first request it loads
        decode.collective_rpc(vllm_rank_store.load_fewer_layers, args=(1, 0))
    out = decode.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                          use_tqdm=False)
    print(f"vllm_disaggregated: {len(out)} requests prefilled by one instance, decoded by another through {storage}")
    del decode
    gc.collect()
    shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":  # vLLM spawns its engine cores: the guard keeps the children from rerunning this
    main()
