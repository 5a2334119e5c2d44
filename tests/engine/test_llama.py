"""engine.model.llama: a plain Llama checkpoint as modules without transformers gives the runner the same
tokens and logits as transformers' model, and the tokenizer the same ids; anything else falls back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvdoctor.engine.model.llama import ChatTokenizer, unsupported
from kvdoctor.engine.model.model import ModelLoadError, load_model, tiny_llama
from kvdoctor.engine.serving.runner import Runner

PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama (its own head, 3 layers) saved as transformers saves a checkpoint."""
    lm = tiny_llama(num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=160, vocab_size=200)
    path = tmp_path_factory.mktemp("ckpt")
    lm.model.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_computes_the_same_logits_from_light_modules(checkpoint, dtype):
    # GIVEN one checkpoint loaded by transformers and as light modules
    hf = load_model(checkpoint, dtype=dtype)
    light = load_model(checkpoint, dtype=dtype, light=True)
    assert type(light.model).__module__ == "kvdoctor.engine.model.llama" and light.model.lm_head.weight.dtype == getattr(torch, dtype)
    # WHEN the runner generates greedily from each
    outs = []
    for lm in (hf, light):
        with Runner.create(lm.model, block_size=4, device_blocks=64, host_blocks=0) as runner:
            outs.append(runner.generate(PROMPTS, max_new_tokens=10, keep_logits=True))
    # THEN the tokens and every logit are the same bits (the runner does the arithmetic; the modules
    # hand it the same weights, norms and rotary angles)
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))


def test_tied_embeddings_share_one_tensor(tmp_path):
    # GIVEN a checkpoint whose head is its embedding (SmolLM2's layout: transformers writes no lm_head.weight)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)).eval()
    model.save_pretrained(str(tmp_path))
    light = load_model(tmp_path, light=True).model
    # THEN the light model's head is the embedding tensor itself, and the runner decodes as from transformers'
    assert light.lm_head.weight.data_ptr() == light.model.embed_tokens.weight.data_ptr()
    outs = []
    for m in (model, light):
        with Runner.create(m, block_size=4, device_blocks=64, host_blocks=0) as runner:
            outs.append([g.token_ids for g in runner.generate(PROMPTS, max_new_tokens=6)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("change, why", [
    ({"model_type": "qwen2"}, "model type 'qwen2'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "scaled RoPE"),
    ({"attention_bias": True}, "projection biases"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_what_the_light_modules_do_not_reproduce_is_named(checkpoint, change, why):
    config = json.loads((checkpoint / "config.json").read_text())
    assert unsupported(config) is None
    assert unsupported({**config, **change}) == why


def test_a_checkpoint_they_do_not_cover_loads_through_transformers(checkpoint, tmp_path):
    # GIVEN a Llama with linear RoPE scaling, which the light modules do not compute
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    # THEN asking for light modules still gives transformers' model
    assert type(load_model(tmp_path, light=True).model).__module__.startswith("transformers.")


def test_a_truncated_checkpoint_is_a_clear_error(checkpoint, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(tmp_path, light=True)


def test_the_light_path_never_imports_transformers(checkpoint):
    script = (f"import sys; from kvdoctor.engine.model.model import load_model; "
              f"lm = load_model({str(checkpoint)!r}, light=True); "
              f"assert type(lm.model).__module__ == 'kvdoctor.engine.model.llama'; "
              f"print(sorted(m for m in sys.modules if m.startswith(('transformers', 'torch._dynamo'))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_chat_tokenizer_gives_transformers_ids(smol):
    # GIVEN the embedded SmolLM2's tokenizer through transformers and through `tokenizers` with its template
    light = ChatTokenizer(smol.path)
    messages = [{"role": "user", "content": "How does a paged KV cache work?"}]
    for msgs in (messages, [{"role": "system", "content": "Answer in one line."}, *messages]):
        ref = smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        # THEN chat prompts, plain text and decoding agree
        assert light.apply_chat_template(msgs, add_generation_prompt=True) == list(ref)
    text = "Blocks move between tiers; versions advance with every token. ünïcödé 123"
    ids = smol.tokenizer(text)["input_ids"]
    assert light(text)["input_ids"] == ids
    assert light.decode(ids + [2], skip_special_tokens=True) == smol.tokenizer.decode(ids + [2], skip_special_tokens=True)



def test_the_chat_template_comes_from_the_tokenizer_config_in_its_saved_forms(tmp_path, smol):
    # GIVEN a checkpoint whose tokenizer_config.json holds named templates and its special tokens as
    # saved added tokens (other exporters' layout), and no chat_template.jinja
    (tmp_path / "tokenizer.json").write_bytes((smol.path / "tokenizer.json").read_bytes())
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}],
        "bos_token": {"content": "<|im_start|>", "lstrip": False}, "eos_token": "<|im_end|>"}))
    tok = ChatTokenizer(tmp_path)
    # THEN the default template renders with the tokens' contents
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user: hi<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == tok._tok.encode(text, add_special_tokens=False).ids
