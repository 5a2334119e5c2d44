"""Fused projections and the decode kernel: same products as the model's own Linears, one copy of the weights."""

from __future__ import annotations

import array
import mmap
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.kv import digest

from kvdoctor.engine.model import attention, decode_layer
from kvdoctor.engine.model.matvec import MAX_ROWS, load, probe
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.model.hugepages import holds
from kvdoctor.engine.model.weights import PageOut, Projection, model_weights

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]
needs_kernel = pytest.mark.skipif(load() is None, reason="no C compiler")


@pytest.fixture()
def model():
    return tiny_llama(hidden_size=128, intermediate_size=256).model


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _linears(layer):
    a, mlp = layer.self_attn, layer.mlp
    return [("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj)]


@pytest.mark.parametrize("kernel", [False, True])
def test_fused_projections_compute_what_the_linears_did_and_keep_one_copy(model, kernel):
    # GIVEN a layer's Linears and their outputs on a few rows, before fusing
    layer = model.model.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    before = {name: m.weight.detach().clone() for name, m in _linears(layer)}
    x = torch.randn(2 * MAX_ROWS, 128, generator=torch.Generator().manual_seed(1))
    # WHEN the runner's weights are built, with the kernel or without
    [w], _ = model_weights([layer], model.lm_head, matvec=load() if kernel else None)
    assert (w.qkv.matvec is not None) == (kernel and load() is not None)
    # THEN q, k, v (and gate, up) become views into one fused weight: still one copy
    assert _same_storage(a.q_proj.weight, a.v_proj.weight) and _same_storage(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert _same_storage(w.qkv.weight, a.k_proj.weight)
    # AND the values are unchanged, and the products are the Linears' for every row count, kernel or GEMM
    for name, m in _linears(layer):
        assert torch.equal(m.weight, before[name])
    want_qkv = torch.cat([F.linear(x, before[n]) for n in ("q", "k", "v")], dim=-1)
    want_gu = torch.cat([F.linear(x, before[n]) for n in ("gate", "up")], dim=-1)
    for rows in (1, 2, 3, 8, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS):
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's madvise and pagemap")
def test_fusing_drops_the_file_pages_of_mapped_weights_and_keeps_written_ones(tmp_path):
    # GIVEN a model saved as safetensors and loaded back (its weights are views of the mapped file),
    # every weight read once, and one weight written in place (that page is now the process's own)
    from kvdoctor.engine.model.model import load_model

    tiny_llama(hidden_size=256, intermediate_size=1024).model.save_pretrained(str(tmp_path))
    model = load_model(tmp_path).model
    layer = model.model.layers[0]
    gate, up = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
    want = torch.cat([gate.detach(), up.detach()]).clone()
    with torch.no_grad():
        up[128, 0] = 7.0  # mid-tensor: inside a whole page
    want[1024 + 128, 0] = 7.0
    assert _pages_in_memory(gate) > 0
    assert PageOut().release([torch.zeros(4096)]) == 0  # anonymous memory is never dropped
    # WHEN gate and up are fused into one new weight with a pager
    [w], _ = model_weights([layer], model.lm_head, pager=PageOut())
    # THEN the read-only old weight's pages left the process, the written one's stayed, and the fused
    # weight (which the model's Linears now view) holds the same values
    assert _pages_in_memory(gate) == 0
    assert _pages_in_memory(up) > 0 and float(up[128, 0].detach()) == 7.0
    assert torch.equal(w.gate_up.weight, want) and _same_storage(layer.mlp.up_proj.weight, w.gate_up.weight)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer.mlp.gate_proj(x), F.linear(x, want[:1024]), atol=0, rtol=0)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, MAX_ROWS), n=st.integers(1, 70), k=st.integers(1, 300), bias=st.booleans(),
       strided=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_matches_a_float64_product_for_any_shape(m, n, k, bias, strided, bf16, seed):
    # GIVEN any shape: rows of w not a multiple of four, K not a multiple of eight, odd row counts,
    # a bias or none, rows of x that are a strided view, and a float32 or a bfloat16 weight
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k, generator=g)[:, ::2] if strided else torch.randn(m, k, generator=g)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None
    w = w.bfloat16() if bf16 else w
    # WHEN the kernel multiplies them
    y = load()(x, w, b)
    # THEN every output is the exact product's (of the weight's own values, and with a bf16 weight of x's
    # values rounded to bf16, as torch's bf16 product takes them), to float32 rounding of a K-term sum
    xs = x.bfloat16() if bf16 else x
    want = F.linear(xs.double(), w.double(), b.double() if b is not None else None)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, atol=1e-5 * k ** 0.5, rtol=1e-5)


@needs_kernel
def test_the_kernel_runs_on_the_threads_torch_is_given():
    # GIVEN torch set to one thread, then two
    x, w = torch.randn(1, 256), torch.randn(4096, 256)
    want = F.linear(x.double(), w.double()).float()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # THEN the kernel's product is the same on either (it takes the count on each call)
            torch.testing.assert_close(load()(x, w, None), want, atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("m", [1, 4, 7, 16])
def test_bf16_kernel_with_shapes_the_tile_path_takes(m):
    # GIVEN a bf16 weight of whole 16-row groups and 32-value chunks (what AMX's tiles take, where the CPU has
    # them: from 4 rows on), an odd number of 16-row groups, and a bias
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 96, generator=g), torch.randn(48, 96, generator=g).bfloat16(), torch.randn(48, generator=g)
    # WHEN the kernel multiplies them THEN it is the exact product of x rounded to bf16, to float32 rounding
    want = F.linear(x.bfloat16().double(), w.double(), b.double())
    torch.testing.assert_close(load()(x, w, b).double(), want, atol=1e-5 * 96 ** 0.5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8])
def test_float_outputs_are_the_rounded_products_widened(dtype, m):
    # GIVEN a projection on the kernel in the model's dtype (bf16 from 4 rows on takes the tile path where
    # there are tiles), and rows of that dtype
    g = torch.Generator().manual_seed(m)
    p = Projection(torch.randn(96, 64, generator=g).to(dtype), None, load())
    x = torch.randn(m, 64, generator=g).to(dtype)
    # WHEN it gives float32 outputs (the runner's logits) THEN they are its outputs in the model's dtype,
    # widened, to the bit: a bf16 model's logits stay bf16 values
    got = p.floats(x)
    assert got.dtype == torch.float32 and torch.equal(got, p(x).float())


def _forget_kernels() -> None:
    """Every compiled kernel's loader looks again: one that found no compiler must not leave later tests on
    their fallbacks (test order decided whether the compiled decode layers were tested at all)."""
    for loader in (probe, decode_layer._kernel, attention._stats_kernel, digest._sums_kernel):
        loader.cache_clear()


def test_without_a_compiler_the_runner_falls_back_to_f_linear(model, tmp_path, monkeypatch):
    # GIVEN no C compiler and no kernel built yet
    had = load() is not None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _forget_kernels()
    try:
        assert load() is None and probe().startswith("no C compiler: ") and "no-such-cc" in probe()
        # WHEN a runner is built THEN it computes with F.linear, and generates
        with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
            assert runner._lm_head.matvec is None
            assert len(runner.generate(PROMPTS[:1], max_new_tokens=3)[0].token_ids) == 3
    finally:
        _forget_kernels()
    # AND the kernel is found again once a compiler is there
    monkeypatch.delenv("CC")
    assert (load() is not None) == had


def test_a_second_runner_reuses_the_fused_views(model):
    # GIVEN the weights built once
    layer = model.model.layers[1]
    [first], head = model_weights([layer], model.lm_head)
    # WHEN they are built again (a second runner on the same model) THEN no new fused weight is made
    [again], head_again = model_weights([layer], model.lm_head)
    assert again.qkv.weight.data_ptr() == first.qkv.weight.data_ptr()
    assert again.down.weight.data_ptr() == first.down.weight.data_ptr()
    assert head_again.weight.data_ptr() == head.weight.data_ptr()


def test_a_weight_written_in_place_is_what_the_projection_reads(model):
    # GIVEN the lm head's projection
    _, head = model_weights(model.model.layers, model.lm_head, model.model.embed_tokens, matvec=load())
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    # WHEN the model's weight is changed in place (fine-tuning, a loaded state dict)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    # THEN the projection computes with the new values: it reads the model's own weight
    torch.testing.assert_close(head(x), F.linear(x, model.lm_head.weight), atol=1e-5, rtol=1e-5)


def test_runner_tokens_do_not_depend_on_the_kernel(model):
    # GIVEN the same prompts through a runner with and without the C kernel
    outs = []
    for native in (False, True):
        with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, native_matvec=native) as runner:
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

