"""Sliding-window attention (Mistral, Qwen2's windowed layers): the runner's tokens and logits equal
transformers' own generate, blocks behind the window are evicted, and the checks see nothing wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvdoctor.checks import make_suite
from kvdoctor.engine.model.attention import AttnLayout
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.features.window import SlidingWindow
from kvdoctor.events import Evict

WINDOW = 8
PROMPTS = [list(range(3, 30)), [5, 6, 7], list(range(40, 53))]
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)


def _mistral():
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **COMMON)).eval()


def _qwen2():
    torch.manual_seed(0)  # layer 0 attends to everything, layer 1 through the window
    return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                        **COMMON)).eval()


def _reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def test_a_windowed_query_sees_only_the_newest_window_keys():
    # GIVEN one decode query at position 9 and a prefill chunk of 3 queries at 7, 8, 9, with a window of 4
    decode = AttnLayout.build([1], [10], sink_tokens=4, window=4)
    chunk = AttnLayout.build([3], [10], sink_tokens=4, window=4)
    # THEN the decode query sees keys 6..9, and each chunk query its own four newest
    assert decode.allowed[0, 0, 0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert decode.keep[0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert [row.nonzero().flatten().tolist() for row in chunk.allowed[0, 0]] == [[4, 5, 6, 7], [5, 6, 7, 8],
                                                                                 [6, 7, 8, 9]]
    # AND a window wider than the keys changes nothing
    assert AttnLayout.build([1], [4], sink_tokens=4, window=8).allowed is None


def test_windows_come_from_the_model_config():
    assert SlidingWindow.of_model(LlamaConfig(**COMMON)) is None
    assert SlidingWindow.of_model(MistralConfig(sliding_window=None, **COMMON)) is None
    mistral = SlidingWindow.of_model(MistralConfig(sliding_window=WINDOW, **COMMON))
    assert mistral.windows == (WINDOW, WINDOW) and mistral.evicts
    qwen = SlidingWindow.of_model(_qwen2().config)
    assert qwen.windows == (None, WINDOW) and not qwen.evicts


@pytest.mark.parametrize("make", [_mistral, _qwen2], ids=["mistral", "qwen2-mixed-layers"])
def test_runner_matches_transformers_through_the_window(make):
    # GIVEN a windowed model and prompts longer and shorter than the window
    model = make()
    refs = [_reference(model, p, 20) for p in PROMPTS]
    events: list = []
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        runner.bus.subscribe(events.extend)
        suite = make_suite()
        runner.bus.subscribe(lambda batch: [suite.observe(e) for e in batch])
        # WHEN they decode together with continuous batching, far past the window
        gens = runner.generate(PROMPTS, max_new_tokens=20, keep_logits=True)
        held = {seq: len(s.blocks) for seq, s in runner.cache.seqs.items()}
    # THEN every row's tokens equal transformers' and the logits agree
    for (tokens, logits), gen in zip(refs, gens):
        assert gen.token_ids == tokens[: len(gen.token_ids)]
        torch.testing.assert_close(torch.stack(gen.logits), logits[: len(gen.logits)], atol=1e-4, rtol=0)
    evicted = [e for e in events if isinstance(e, Evict)]
    if SlidingWindow.of_model(model.config).evicts:
        # AND with every layer windowed, blocks behind the window went as "window" evictions
        assert evicted and {e.reason for e in evicted} == {"window"}
    else:
        # AND with a full-attention layer, nothing may go
        assert evicted == []
    assert held == {}  # every sequence ended and released what it held
    # AND kvdoctor's own checks find nothing wrong with window evictions
    findings = suite.findings + suite.finish()
    assert findings == [], "\n".join(f.message for f in findings)


def test_a_long_windowed_generation_holds_about_a_window_of_blocks():
    # GIVEN Mistral-style windows (every layer) and a long prompt
    model = _mistral()
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        runner.cache.add_sequence("s", prompt_len=40)
        runner.forward([("s", list(range(3, 43)))])
        most = 0
        # WHEN it decodes token after token
        for t in range(30):
            runner.forward([("s", [5 + t % 50])])
            most = max(most, len(runner.cache.seqs["s"].blocks))
        # THEN it never holds more than the window's blocks plus the one being written
        assert most <= WINDOW // 4 + 2
        assert runner.cache.seq_len("s") == 70


@pytest.mark.parametrize("make", [_mistral, _qwen2], ids=["mistral", "qwen2-mixed-layers"])
def test_engine_cache_under_generate_keeps_transformers_window_mask(make):
    # GIVEN a windowed model generating through kvdoctor's Cache (transformers builds the window mask itself)
    from kvdoctor.engine.model.hf import EngineCache

    model = make()
    prompt = PROMPTS[0]
    tokens, _ = _reference(model, prompt, 16)
    with EngineCache(model, block_size=4, device_blocks=64, host_blocks=0) as cache:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                             cache=cache)
    # THEN its tokens are transformers' own
    assert out[0, len(prompt):].tolist() == tokens
