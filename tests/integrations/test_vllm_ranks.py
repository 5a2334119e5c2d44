"""Tensor-parallel ranks under the vLLM plugin: each worker writes its rank's trace, and ranks must agree.

One vLLM engine at ``tensor_parallel_size=2`` (a small random Llama with 4 heads, 2 KV heads and head size
64, from a config with a fixed seed; each worker bound to a core) serves every test; the plugin is on
(``KVDOCTOR_TRACE``), so each worker process traces its rank. Each test restarts the ranks' traces in a
folder of its own through vLLM's ``collective_rpc``, patches a fault into one rank the same way
(``vllm_rank_faults``), serves a few requests and checks the folder as one workload, as
``kvdoctor check --trace DIR`` does. vLLM's CPU start-up costs about a minute on 2 cores: one engine here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from kvdoctor.workload import TraceSet, WorkloadSession  # noqa: E402

import vllm_rank_faults as faults  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# one prefix of more than a block (32 tokens): the requests after the first hit its cached block
PREFIX = ("You are a careful assistant for people who run language models in production. You answer in two or "
          "three short sentences and say plainly when you are unsure. ")
PROMPTS = [PREFIX + q for q in ("The KV cache of a transformer holds", "Tensor parallel ranks each hold",
                                "A block table maps", "Pipeline stages pass activations")]


def _tiny_llama(folder: Path) -> Path:
    """A random Llama vLLM's CPU attention runs at TP=2: head size 64, 4 heads, 2 KV heads (one per rank)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvdoctor.engine.model.model import convert_embedded

    tok = AutoTokenizer.from_pretrained(str(convert_embedded()))
    config = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def llm():
    import cloudpickle
    from vllm import LLM

    cloudpickle.register_pickle_by_value(faults)  # the workers need not import the tests
    work = Path(tempfile.mkdtemp(prefix="kvdoctor-vllm-ranks-"))
    # for as long as the engine serves: collective_rpc sends this module's functions, and a fixed KV space
    os.environ.update(VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    # while the engine starts (its workers inherit them): one core a rank, and the plugin on
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "KVDOCTOR_TRACE": str(work / "run.kvtrace")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = LLM(model=str(_tiny_llama(work / "model")), dtype="float32", enforce_eager=True, max_model_len=256,
                     block_size=32, num_gpu_blocks_override=32, tensor_parallel_size=2, max_num_seqs=4, seed=0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield engine
    engine.collective_rpc(faults.close)
    del engine


def _serve(llm, folder: Path, names: list[str], *, max_tokens: int = 40) -> list:
    """Restart the ranks' traces in ``folder``, serve one request per name (the id starts with it), close the
    traces and check them as one workload; returns the findings."""
    from vllm import SamplingParams

    paths = llm.collective_rpc(faults.retrace, args=(str(folder),))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for name, prompt in zip(names, PROMPTS):
        engine.add_request(name, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    llm.collective_rpc(faults.close)
    assert sorted(paths) == [str(folder / "tp0.kvtrace"), str(folder / "tp1.kvtrace")]
    return WorkloadSession(TraceSet.open([str(folder)])).run().findings


def test_ranks_of_a_clean_tensor_parallel_run_agree_and_find_nothing(llm, tmp_path):
    # GIVEN four requests sharing a prefix block served at TP=2 (prefix hits), prefills beside decodes
    findings = _serve(llm, tmp_path, ["a", "b", "c", "d"])
    # THEN both ranks' traces are read and no rule of any severity finds anything
    assert findings == [], [f"{f.check}/{f.rule}: {f.message}" for f in findings]


def _divergence(llm, folder: Path, fault, name: str) -> tuple:
    """Serve a request named ``name`` beside a clean one with ``fault`` on rank 1; returns the one divergence
    found (on rank 1's trace, naming both ranks and the request) and what the fault said on each rank."""
    said = llm.collective_rpc(fault, args=(1, name))
    try:
        findings = _serve(llm, folder, ["a", name], max_tokens=8)
    finally:
        llm.collective_rpc(faults.undo)
    divergence = [f for f in findings if f.rule == "divergence"]
    assert len(divergence) == 1, [f"{f.check}/{f.rule}: {f.message}" for f in findings]
    f = divergence[0]
    assert f.trace.endswith("tp1.kvtrace") and "tp 1" in f.message and "tp 0" in f.message
    assert str(f.seq).startswith(name)
    return f, said


def test_a_rank_whose_slot_mapping_skips_a_request_is_named(llm, tmp_path):
    # GIVEN rank 1 whose slot mapping sends one request's tokens nowhere (its K/V never written on that rank)
    f, _ = _divergence(llm, tmp_path, faults.skip_writes, "skip")
    # THEN the ranks diverge at the request's first step: rank 1's trace, the request and its block named
    assert f.block is not None and "write" in f.message


def test_a_rank_holding_another_block_table_is_named(llm, tmp_path):
    # GIVEN rank 1 whose copy of one request's block table ends in another block than rank 0's
    f, said = _divergence(llm, tmp_path, faults.other_block, "moved")
    # THEN the ranks diverge where the request took its blocks: rank 1's block named
    assert f.block == next(b for b in said if b is not None)
