"""A decode step's layers in two compiled calls each, around the K/V store, for plain Llama models on CPU.

At batch 1 a bf16 SmolLM2 step spent as long in the glue between its products as in the products:
~60 small torch ops a layer (norms, rotations, dtype conversions, the SwiGLU product, residuals, the
attention's gathers and softmax), 1.5-5 us each. ``decode_layer.c`` does a layer's glue in a few
passes over rows of a few hundred floats: ``pre`` (RMSNorm, the q/k/v product, RoPE) before the
runner stores the new K/V through the cache (so writes, digests and faults are the cache's as
always), ``post`` (attention over the layer's paged K/V, the o product, residual, RMSNorm, the gate/up
product, SiLU, the down product, residual) after. It computes what the torch path computes, rounding
bf16 where torch's bf16 ops round (see the C file); it hands back each row's newest-query scores and
probabilities, so attention statistics see what attention used.

It applies to a step whose rows are all decode rows over K/V the cache holds in the model's dtype,
with none of the features that change attention (block-sparse reads, sliding windows, token merging,
long-context streaming, the attention-nan fault's hook), and to models whose layers are plain Llama
layers in float32 or bfloat16 (no q/k norms, no biases, SiLU); elsewhere the runner's torch path runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from . import native
from .attention import Newest
from .matvec import MAX_ROWS
from .weights import LayerWeights

__all__ = ["DecodeLayers", "DecodeStep"]

_SOURCE = Path(__file__).with_name("decode_layer.c")
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_PRE = [ctypes.c_int] + [_I64] * 5 + [_PTR, _PTR, _F32, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int]
_POST = ([ctypes.c_int] + [_I64] * 6 + [_PTR] * 4 + [_I64, _I64, _PTR, _F32, _PTR, _PTR, _I64]
         + [_PTR, _PTR, _F32, _PTR, _PTR, _PTR, ctypes.c_int])
_MODEL_TYPES = {"llama", "mistral"}  # layers exactly Llama's: pre-norms, no q/k norms, no multipliers


@functools.cache
def _kernels() -> tuple[Any, Any] | None:
    lib = native.load(_SOURCE, {"kvdoctor_layer_pre": _PRE, "kvdoctor_layer_post": _POST})
    return None if isinstance(lib, str) else (lib.kvdoctor_layer_pre, lib.kvdoctor_layer_post)


@dataclass(frozen=True)
class _Layer:
    """The addresses one layer's calls need, read once; ``tensors`` keeps what they point into alive (the
    runner's projections and norms hold the same tensors: a parameter replaced later is not read by either)."""

    norm1: int
    eps1: float
    qkv: int
    o: int
    norm2: int
    eps2: float
    gate_up: int
    down: int
    scale: float
    tensors: tuple[torch.Tensor, ...]


def _norm(norm: Any, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
    """The weight and eps of a plain RMSNorm in ``dtype`` (transformers' Llama norm or ours)."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    plain = type(norm).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "RMSNorm")
    if not plain or w is None or eps is None or w.dtype != dtype or w.dim() != 1 or not w.is_contiguous():
        return None
    return w.detach(), float(eps)


class DecodeLayers:
    """The compiled layers of one model; ``for_model`` says None where they do not apply."""

    def __init__(self, layers: list[_Layer], dims: tuple[int, int, int, int, int], dtype: torch.dtype,
                 kernels: tuple[Any, Any]) -> None:
        self._layers = layers
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate = dims
        self.dtype = dtype
        self._pre, self._post = kernels

    @classmethod
    def for_model(cls, model: Any, modules: Sequence[Any], weights: Sequence[LayerWeights]) -> DecodeLayers | None:
        """For a plain Llama model on CPU in float32 or bf16 whose projections run on the matvec kernel
        (``KVDOCTOR_DECODE_LAYER=0`` switches them off: the torch path, as for a benchmark's A/B)."""
        if os.environ.get("KVDOCTOR_DECODE_LAYER", "1") == "0":
            return None
        cfg = model.config
        param = next(model.parameters())
        H, H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        if (cfg.model_type not in _MODEL_TYPES or param.device.type != "cpu"
                or param.dtype not in (torch.float32, torch.bfloat16) or getattr(cfg, "hidden_act", "silu") != "silu"
                or D % 8 or H % H_kv):
            return None
        kernels = _kernels()
        if kernels is None:
            return None
        layers = []
        for module, w in zip(modules, weights):
            a = module.self_attn
            projections = (w.qkv, w.o, w.gate_up, w.down)
            if hasattr(a, "q_norm") or any(p.matvec is None or p.bias is not None for p in projections):
                return None
            n1, n2 = _norm(module.input_layernorm, param.dtype), _norm(module.post_attention_layernorm, param.dtype)
            if n1 is None or n2 is None or type(module.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
                return None
            qkv, o, gate_up, down = (p.weight for p in projections)
            layers.append(_Layer(norm1=n1[0].data_ptr(), eps1=n1[1], qkv=qkv.data_ptr(), o=o.data_ptr(),
                                 norm2=n2[0].data_ptr(), eps2=n2[1], gate_up=gate_up.data_ptr(), down=down.data_ptr(),
                                 scale=float(a.scaling), tensors=(n1[0], n2[0], qkv, o, gate_up, down)))
        intermediate = weights[0].gate_up.weight.shape[0] // 2
        return cls(layers, (cfg.hidden_size, H, H_kv, D, intermediate), param.dtype, kernels)

    def step(self, kv_lens: Sequence[int], kv_rows: torch.Tensor, blocks: int, block_size: int,
             scores: bool) -> DecodeStep | None:
        """The buffers of one decode step over rows with ``kv_lens`` keys (None above ``MAX_ROWS`` rows);
        with ``scores`` each layer keeps its rows' newest-query scores and probabilities."""
        M = len(kv_lens)
        if M > MAX_ROWS:
            return None
        return DecodeStep(self, M, max(kv_lens), torch.tensor(kv_lens, dtype=torch.int32), kv_rows, blocks,
                          block_size, scores)


class DecodeStep:
    """One step's buffers: q/k/v of every layer (the cache stores views of them), float scratch, and the
    scores and probabilities attention leaves for the statistics (every layer's, or one layer's reused)."""

    def __init__(self, layers: DecodeLayers, M: int, T: int, lens: torch.Tensor, kv_rows: torch.Tensor,
                 blocks: int, block_size: int, keep_scores: bool) -> None:
        L = layers
        H, H_kv, D, hidden, inter = L.heads, L.kv_heads, L.head_dim, L.hidden, L.intermediate
        self.L, self.M, self.T, self.lens, self.kv_rows = L, M, T, lens, kv_rows
        self.blocks, self.block_size, self.keep_scores = blocks, block_size, keep_scores
        self.width = (H + 2 * H_kv) * D
        self.qkv = torch.empty(len(L._layers), M, self.width, dtype=L.dtype)
        widest = max(inter, hidden, H * D)
        self.scratch = torch.empty(M * (H * D + 2 * inter + 2 * widest + 2 * hidden + self.width))
        self.newest = torch.empty(len(L._layers) if keep_scores else 1, 2, M, H, T)
        self.threads = torch.get_num_threads()
        self._bf = int(L.dtype == torch.bfloat16)

    def pre(self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor | None = None,
            rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm, q/k/v and RoPE of layer ``li`` for ``x`` (M, hidden); the new K and V (M, H_kv, D), stored
        into the layer's arena ``kv`` at ``rows`` when given (the cache's ``store_rows``), else for the caller to store."""
        L, w = self.L, self.L._layers[li]
        qkv = self.qkv[li]
        L._pre(self._bf, self.M, L.hidden, L.heads, L.kv_heads, L.head_dim, x.data_ptr(), w.norm1, w.eps1, w.qkv,
               cos.data_ptr(), sin.data_ptr(), qkv.data_ptr(), kv.data_ptr() if rows is not None else None,
               rows.data_ptr() if rows is not None else None, self.scratch.data_ptr(), self.threads)
        H, H_kv, D = L.heads, L.kv_heads, L.head_dim
        return (qkv[:, H * D : (H + H_kv) * D].view(self.M, H_kv, D), qkv[:, (H + H_kv) * D :].view(self.M, H_kv, D))

    def post(self, li: int, x: torch.Tensor, kv: torch.Tensor) -> Newest | None:
        """Attention over ``kv`` (the layer's arena, the new K/V stored) and the rest of layer ``li``, into
        ``x`` in place; the rows' newest-query scores and probabilities when the step keeps them."""
        L, w = self.L, self.L._layers[li]
        newest = self.newest[li if self.keep_scores else 0]
        L._post(self._bf, self.M, L.hidden, L.heads, L.kv_heads, L.head_dim, L.intermediate, x.data_ptr(),
                self.qkv[li].data_ptr(), kv.data_ptr(), self.kv_rows.data_ptr(), self.blocks, self.block_size,
                self.lens.data_ptr(), w.scale, newest[0].data_ptr(), newest[1].data_ptr(), self.T, w.o, w.norm2,
                w.eps2, w.gate_up, w.down, self.scratch.data_ptr(), self.threads)
        return Newest(newest[0], newest[1]) if self.keep_scores else None
