"""kvdoctor's vLLM plugin and LoRA adapters on real vLLM: adapter identity as part of a block's identity.

One LoRA-enabled engine (SmolLM2, prefix caching) serves every test in-process; the adapters are tiny random
LoRAs on the key and value projections, written from the model's config with a fixed seed. A clean run with
several adapters gives no finding; vLLM's prefix-key bugs reproduced by patching its key in-process (as the
releases before each fix built it) are each caught naming the request, the block and the adapters. Run with
``./kvd test-vllm``.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.engine.core import EngineCore  # noqa: E402

from kvdoctor.events import Adapter, SeqStart, Share  # noqa: E402
from kvdoctor.integrations.vllm import PREFIX_CACHE, VllmTracer  # noqa: E402
from kvdoctor.integrations.vllm_lora import watch_adapters  # noqa: E402

from vllm_harness import judge  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = ("You are a careful assistant for people who run language models in production. You answer in two or "
          "three short sentences and say plainly when you are unsure. ") * 3 + "What is a KV cache?"
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def model_dir():
    from kvdoctor.engine.model.model import convert_embedded

    return str(convert_embedded())


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, block_size=32,
                 num_gpu_blocks_override=24, enable_prefix_caching=True, max_num_seqs=4, seed=0,
                 gpu_memory_utilization=0.2, enable_lora=True, max_lora_rank=8, max_loras=2)
    yield engine
    del engine


def write_adapter(path, model_dir, seed):
    """A rank-8 LoRA on every layer's k_proj and v_proj, random with ``seed``, in PEFT's file layout."""
    config = json.loads((open(os.path.join(model_dir, "config.json"))).read())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config["num_key_value_heads"] * (hidden // heads)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, hidden, generator=g) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(kv, 8, generator=g) * 0.05
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"],
                   "bias": "none", "base_model_name_or_path": model_dir, "task_type": "CAUSAL_LM"}, f)
    return str(path)


@pytest.fixture
def adapters(tmp_path, model_dir):
    return {name: write_adapter(tmp_path / name, model_dir, seed) for seed, name in enumerate("abc", 1)}


@pytest.fixture
def traced(llm, tmp_path):
    """A tracer with adapters watched on an emptied prefix cache, no adapter left loaded; yields the findings."""
    engine_core = llm.llm_engine.engine_core.engine_core
    sched = engine_core.scheduler
    for lora_id in llm.llm_engine.list_loras():
        llm.llm_engine.remove_lora(lora_id)
    assert sched.kv_cache_manager.block_pool.reset_prefix_cache(), "a previous test left blocks held"
    path = tmp_path / "vllm.kvtrace"
    tracer = VllmTracer(sched, str(path), engine="vllm test")
    sched._kvdoctor = tracer
    watch_adapters(tracer, EngineCore)

    def findings():
        tracer.detach()
        return judge(path)

    yield findings
    if tracer._wrapped:
        tracer.detach()
    vars(sched).pop("_kvdoctor", None)
    vars(sched).pop("_kvdoctor_adapters", None)


def _generate(llm, lora=None, salt=None):
    prompt = {"prompt": PROMPT, "cache_salt": salt} if salt else PROMPT
    return llm.generate([prompt], PARAMS, lora_request=lora, use_tqdm=False)[0].outputs[0].text


def _hits(events):
    return [e for e in events if type(e) is Share and e.seq != PREFIX_CACHE]


def test_a_clean_run_with_several_adapters_and_an_unchanged_reload_gives_no_finding(llm, traced, adapters):
    # GIVEN the base model and two adapters serving one prompt twice each, and adapter a re-added in place unchanged
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    for lora in (None, a, b, None, a, b):
        _generate(llm, lora)
    assert llm.llm_engine.add_lora(LoRARequest("a", 1, adapters["a"], load_inplace=True))
    _generate(llm, a)
    findings, events = traced()
    # THEN every request hit its own adapter's blocks, a and b loaded once each, and nothing is found
    loads = [(e.op, e.name, e.adapter_id, e.load) for e in events if type(e) is Adapter]
    assert loads == [("load", "a", 1, 1), ("load", "b", 2, 1)], loads
    starts = {e.adapter for e in events if type(e) is SeqStart}
    assert starts == {None, "a", "b"}
    assert len(_hits(events)) >= 4
    assert findings == []


@pytest.mark.parametrize("reset", [False, True])
def test_a_lora_reloaded_in_place_hits_its_old_contents_blocks(llm, traced, adapters, model_dir, reset):
    # GIVEN adapter a serving a prompt, then its files rewritten (a training step) and reloaded in place
    # under the same name, id and path (vllm PR #42495: the RL LoRA sync)
    _generate(llm, LoRARequest("a", 1, adapters["a"]))
    write_adapter(adapters["a"], model_dir, seed=99)
    assert llm.llm_engine.add_lora(LoRARequest("a", 1, adapters["a"], load_inplace=True))
    if reset:
        assert llm.reset_prefix_cache()
    # WHEN the same prompt comes again under a
    _generate(llm, LoRARequest("a", 1, adapters["a"]))
    findings, events = traced()
    loads = [(e.op, e.load) for e in events if type(e) is Adapter]
    assert loads == [("load", 1), ("reload", 2)], loads
    if reset:
        assert findings == [], findings
        return
    # THEN the hit on the first load's blocks is found, naming the request, the block and both loads
    (f,) = [f for f in findings if f.check == "adapters"]
    assert f.rule == "foreign-hit" and isinstance(f.block, int)
    assert "load 1 -> 2" in f.message and "#42495" in f.message
    assert {x.check for x in findings} == {"adapters"}, findings


def _lora_key_without(monkeypatch, part):
    """vLLM's LoRA prefix-key part as releases before the fix built it: the name alone, untagged."""
    if part == "id and path":
        monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys",
                            lambda request: [request.lora_request.lora_name] if request.lora_request else [])
    else:  # untagged: a LoRA name compares equal to a cache salt of the same text
        monkeypatch.setattr(kv_cache_utils, "_gen_lora_extra_hash_keys",
                            lambda request: [("cache_salt", request.lora_request.lora_name)]
                            if request.lora_request else [])


def test_two_adapters_with_one_name_share_blocks_when_the_key_holds_the_name_only(llm, traced, adapters, monkeypatch):
    # GIVEN vLLM's key keeping the adapter's name only (vllm #30931), and two adapters named x with ids 1 and 2
    _lora_key_without(monkeypatch, "id and path")
    _generate(llm, LoRARequest("x", 1, adapters["a"]))
    # WHEN the other x serves the same prompt
    _generate(llm, LoRARequest("x", 2, adapters["b"]))
    findings, events = traced()
    # THEN its hit on the first x's blocks is a foreign hit naming both ids
    assert _hits(events)
    (f,) = [f for f in findings if f.check == "adapters"]
    assert f.rule == "foreign-hit" and "ids 1 and 2" in f.message and "#30931" in f.message


def test_a_cache_salt_equal_to_an_adapters_name_reaches_its_blocks_when_parts_are_untagged(llm, traced, adapters,
                                                                                         monkeypatch):
    # GIVEN untagged key parts (vllm #44701): adapter COLLIDE serves a prompt
    _lora_key_without(monkeypatch, "tag")
    _generate(llm, LoRARequest("COLLIDE", 1, adapters["a"]))
    # WHEN a base-model request salted COLLIDE sends the same prompt
    _generate(llm, salt="COLLIDE")
    findings, _ = traced()
    # THEN adapters/key-collision names the salt and the adapter (the prefix check sees the content keys differ too)
    (f,) = [f for f in findings if f.check == "adapters"]
    assert f.rule == "key-collision" and "salt='COLLIDE'" in f.message and "adapter='COLLIDE'" in f.message
    assert f.evidence["hit_under"] is None and f.evidence["computed_under"]["name"] == "COLLIDE"
