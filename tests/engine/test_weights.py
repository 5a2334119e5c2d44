"""Fused and prepacked projections: same products as the model's own Linears, one copy of the weights."""

from __future__ import annotations

import array
import mmap
import sys

import pytest
import torch
import torch.nn.functional as F

from kvdoctor.engine.model import tiny_llama
from kvdoctor.engine.runner import Runner
from kvdoctor.engine.weights import PageOut, layer_weights, lm_head_weights

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]


@pytest.fixture()
def model():
    return tiny_llama(hidden_size=128, intermediate_size=256).model


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _linears(layer):
    a, mlp = layer.self_attn, layer.mlp
    return [("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj)]


@pytest.mark.parametrize("pack", [False, True])
def test_fused_projections_compute_what_the_linears_did_and_keep_one_copy(model, pack):
    # GIVEN a layer's Linears and their outputs on a few rows, before fusing
    layer = model.model.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    before = {name: m.weight.detach().clone() for name, m in _linears(layer)}
    ptrs = {name: m.weight.data_ptr() for name, m in _linears(layer)}
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    # WHEN the runner's weights are built
    w = layer_weights(layer, pack=pack)
    packed = pack and torch.backends.mkldnn.is_available()
    assert (w.qkv.packed is not None) == packed
    if packed:
        # THEN packed, the projections keep no dense weight and the model's own weights are left in place
        assert w.qkv.weight is None and w.gate_up.weight is None
        assert {name: m.weight.data_ptr() for name, m in _linears(layer)} == ptrs
    else:
        # THEN unpacked, q, k, v (and gate, up) become views into one fused weight: still one copy
        assert _same_storage(a.q_proj.weight, a.v_proj.weight) and _same_storage(mlp.gate_proj.weight, mlp.up_proj.weight)
        assert _same_storage(w.qkv.weight, a.k_proj.weight)
    # AND the values are unchanged, and the products are the Linears' for every row count
    for name, m in _linears(layer):
        assert torch.equal(m.weight, before[name])
    want_qkv = torch.cat([F.linear(x, before[n]) for n in ("q", "k", "v")], dim=-1)
    want_gu = torch.cat([F.linear(x, before[n]) for n in ("gate", "up")], dim=-1)
    assert w.qkv.shape == (want_qkv.shape[1], 128) and w.qkv.nbytes == want_qkv.shape[1] * 128 * 4
    for rows in (1, 2, 8):
        torch.testing.assert_close(w.qkv(x[:rows]), want_qkv[:rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.gate_up(x[:rows]), want_gu[:rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w.down(torch.cat([x, x], -1)[:rows]), mlp.down_proj(torch.cat([x, x], -1)[:rows]),
                                   atol=1e-5, rtol=1e-5)


def _pages_in_memory(t: torch.Tensor) -> int:
    """How many of the whole pages ``t`` spans are mapped in this process (``/proc/self/pagemap`` bit 63)."""
    page = mmap.PAGESIZE
    lo, hi = -(-t.data_ptr() // page), (t.data_ptr() + t.numel() * t.element_size()) // page
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(lo * 8)
        return sum(e >> 63 for e in array.array("Q", fh.read((hi - lo) * 8)))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not sys.platform.startswith("linux"),
                    reason="needs oneDNN and Linux's madvise")
def test_packing_drops_the_file_pages_of_mapped_weights_and_keeps_written_ones(tmp_path):
    # GIVEN a model saved as safetensors and loaded back (its weights are views of the mapped file),
    # every weight read once, and one weight written in place (that page is now the process's own)
    from kvdoctor.engine.model import load_model

    tiny_llama(hidden_size=256, intermediate_size=1024).model.save_pretrained(str(tmp_path))
    model = load_model(tmp_path).model
    layer = model.model.layers[0]
    up, down = layer.mlp.up_proj.weight, layer.mlp.down_proj.weight
    want_up = up.detach().clone()
    with torch.no_grad():
        down[128, 0] = 7.0  # mid-tensor: inside a whole page
    assert _pages_in_memory(up) > 0
    assert PageOut().release([torch.zeros(4096)]) == 0  # anonymous memory is never dropped
    # WHEN the layer's weights are packed with a pager
    w = layer_weights(layer, pack=True, pager=PageOut())
    # THEN the read-only weight's pages left the process, the written one's stayed, and the model computes
    # the same products as before, mapping the file's pages again
    assert _pages_in_memory(up) == 0
    assert _pages_in_memory(down) > 0 and float(down[128, 0].detach()) == 7.0
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer.mlp.up_proj(x), F.linear(x, want_up), atol=0, rtol=0)
    torch.testing.assert_close(w.gate_up(x)[:, 1024:], F.linear(x, want_up), atol=1e-5, rtol=1e-5)


def test_a_second_runner_reuses_the_fused_views_and_packed_copies(model):
    # GIVEN the weights built once
    layer = model.model.layers[1]
    first = layer_weights(layer, pack=True)
    # WHEN they are built again (a second runner on the same model)
    second = layer_weights(layer, pack=True)
    # THEN no new fused weight or packed copy is made
    if first.qkv.packed is not None:
        assert second.qkv.packed is first.qkv.packed and second.gate_up.packed is first.gate_up.packed
    else:
        assert second.qkv.weight.data_ptr() == first.qkv.weight.data_ptr()


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

