"""Fused and prepacked projections: same products as the model's own Linears, no second dense copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvdoctor.engine.model import tiny_llama
from kvdoctor.engine.runner import Runner
from kvdoctor.engine.weights import PACKED_MIN_ROWS, layer_weights, lm_head_weights

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]


@pytest.fixture()
def model():
    return tiny_llama(hidden_size=128, intermediate_size=256).model


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("pack", [False, True])
def test_fused_projections_compute_what_the_linears_did_and_share_their_memory(model, pack):
    # GIVEN a layer's Linears and their outputs on a few rows, before fusing
    layer = model.model.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    before = {name: m.weight.detach().clone() for name, m in
              [("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj)]}
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    # WHEN the runner's weights are built
    w = layer_weights(layer, pack=pack)
    # THEN q, k, v (and gate, up) are views into one fused weight, unchanged, and the model still computes with them
    assert _same_storage(a.q_proj.weight, a.v_proj.weight) and _same_storage(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert _same_storage(w.qkv.weight, a.k_proj.weight)
    for name, m in [("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj)]:
        assert torch.equal(m.weight, before[name])
    want_qkv = torch.cat([F.linear(x, before[n]) for n in ("q", "k", "v")], dim=-1)
    want_gu = torch.cat([F.linear(x, before[n]) for n in ("gate", "up")], dim=-1)
    for rows in (1, PACKED_MIN_ROWS, 8):  # one row takes the dense path, more the packed one (when packed)
        torch.testing.assert_close(w.qkv(x[:rows]), want_qkv[:rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.gate_up(x[:rows]), want_gu[:rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.down(torch.cat([x, x], -1)[:rows]), mlp.down_proj(torch.cat([x, x], -1)[:rows]),
                                   atol=1e-5, rtol=1e-5)
    assert (w.qkv.packed is not None) == (pack and torch.backends.mkldnn.is_available())


def test_a_second_runner_reuses_the_fused_views_and_packed_copies(model):
    # GIVEN the weights built once
    layer = model.model.layers[1]
    first = layer_weights(layer, pack=True)
    # WHEN they are built again (a second runner on the same model)
    second = layer_weights(layer, pack=True)
    # THEN no new fused weight or packed copy is made
    assert second.qkv.weight.data_ptr() == first.qkv.weight.data_ptr()
    assert second.gate_up.weight.data_ptr() == first.gate_up.weight.data_ptr()
    if first.qkv.packed is not None:
        assert second.qkv.packed is first.qkv.packed


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_a_weight_written_in_place_is_packed_again(model):
    # GIVEN a packed lm head
    head = lm_head_weights(model.lm_head, pack=True)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    # WHEN the model's weight is changed in place (fine-tuning, a loaded state dict)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    again = lm_head_weights(model.lm_head, pack=True)
    # THEN the new projection uses the new values, the stale packed copy is not reused
    assert again.packed is not head.packed
    torch.testing.assert_close(again(x), F.linear(x, model.lm_head.weight), atol=1e-5, rtol=1e-5)


def test_runner_tokens_do_not_depend_on_packing(model):
    # GIVEN the same prompts through a runner with and without prepacked weights
    outs = []
    for pack in (False, True):
        with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, pack_weights=pack) as runner:
            outs.append(runner.generate(PROMPTS, max_new_tokens=12, keep_logits=True))
    # THEN the tokens are the same and the logits agree to the tests' usual tolerance
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-4, rtol=0)
    # AND the Hugging Face model still generates with its (now fused) weights
    out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, len(PROMPTS[0]) + 4)


def _near_tie(logits: torch.Tensor) -> bool:
    """The two largest logits within a few bf16 roundings of each other (bf16 keeps 8 significant bits)."""
    top = logits.float().topk(2).values
    return bool(top[0] - top[1] <= 4 * 2.0 ** -8 * top[0].abs().clamp(min=1.0))


def test_bf16_runner_tokens_match_transformers_bf16_generate():
    # GIVEN a model in bf16: the runner's weights, activations and cache are bf16 like transformers' own
    model = tiny_llama(hidden_size=128, intermediate_size=256, dtype="bfloat16").model
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        assert runner.cache.config.dtype == "bfloat16" and runner.dtype == torch.bfloat16
        outs = runner.generate(PROMPTS, max_new_tokens=12, keep_logits=True)
    # WHEN transformers' generate decodes the same prompts greedily in bf16
    for prompt, ours in zip(PROMPTS, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        ref = ref[0, len(prompt):].tolist()
        # THEN the tokens are the same, or they part first where the runner's top two logits nearly tie
        first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref)) if a != b), None)
        assert first is None or _near_tie(ours.logits[first]), (first, ours.token_ids, ref)
