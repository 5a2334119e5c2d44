"""The runner's projections: q/k/v and gate/up fused into one matmul each, and prepacked for oneDNN on CPU.

A decode step multiplies a handful of rows by every weight of the model, so its time
goes to many small matmuls. Two things make them cheaper without changing what they
compute:

- **Fusion.** The q, k and v projections read the same input, as do gate and up: one
  matmul over the concatenated weight replaces three (two) calls. The concatenated
  weight is built once and the model's own ``nn.Linear`` weights become views into it,
  so memory is not doubled and the Hugging Face model keeps working unchanged.
- **Prepacking.** PyTorch's CPU ``linear`` calls MKL, whose GEMM for a few rows against
  a wide weight runs far below the core's peak on the AMD machines we measure on (a
  batch of eight takes about four times as long as one row). oneDNN with the weight
  reordered once into its blocked layout runs the same product 1.5-3x faster from two
  rows up. The packed copy is extra memory (one more copy of the linear weights), kept
  per weight and reused by every runner on the same model; one row stays on MKL's GEMV,
  which is as fast.

Both reorder floating-point sums, so logits differ from transformers' in the last bits
(well inside the 1e-4 the tests allow); the greedy tokens are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["Projection", "LayerWeights", "layer_weights", "lm_head_weights", "rms_norm", "PACKED_MIN_ROWS"]

PACKED_MIN_ROWS = 2  # one row: MKL's GEMV is as fast as oneDNN's packed GEMM and needs no packed copy

# Attribute of the model's nn.Linear (the first of a fused group) that keeps its packed copy, so every
# runner on the same model shares one, and it goes with the model.
_PACKED_ATTR = "_kvdoctor_packed"


@dataclass(frozen=True)
class Projection:
    """``x @ weight.T + bias`` for ``x`` (M, K); oneDNN's prepacked copy of ``weight`` from ``PACKED_MIN_ROWS`` rows.

    The packed copy is split along K in two halves whose products are added: oneDNN accumulates each
    output along K in one running sum, which on its own drifts from MKL's result about twice as far
    (SmolLM2's logits then leave transformers' by more than 1e-4); two half sums match MKL's error
    for about 10% more time."""

    weight: torch.Tensor  # (N, K)
    bias: torch.Tensor | None  # (N,)
    packed: tuple[torch.Tensor, torch.Tensor] | None  # oneDNN layouts of weight[:, :K/2] and weight[:, K/2:]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
            lo, hi = self.packed
            k = lo.shape[1]
            y = torch.ops.mkldnn._linear_pointwise(x[:, :k], lo, self.bias, "none", [], "")  # (M, N)
            return y.add_(torch.ops.mkldnn._linear_pointwise(x[:, k:], hi, None, "none", [], ""))
        return F.linear(x, self.weight, self.bias)  # (M, N)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's projections as the runner calls them."""

    qkv: Projection  # (H + 2 H_kv) * D outputs: q, then k, then v
    o: Projection
    gate_up: Projection  # 2 * intermediate outputs: gate, then up
    down: Projection


def _fused(modules: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (sum N, K) (and bias) over ``modules`` (nn.Linear); their parameters become views into it.

    A second runner on the same model finds the views already in place and reuses them."""
    weights = [m.weight for m in modules]
    base = weights[0]
    rows = [w.shape[0] for w in weights]
    adjacent = all(w.is_contiguous() and w.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                   for w in weights)
    offsets = [base.storage_offset() + sum(rows[:i]) * base.shape[1] for i in range(len(rows))]
    if adjacent and all(w.storage_offset() == o for w, o in zip(weights, offsets)):
        weight = base.detach().as_strided((sum(rows), base.shape[1]), (base.shape[1], 1), base.storage_offset())
    else:
        weight = torch.cat([w.detach() for w in weights])  # (sum N, K)
        for m, w in zip(modules, weight.split(rows)):
            m.weight = torch.nn.Parameter(w, requires_grad=False)
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return weight, None
    bias = torch.cat([b.detach() if b is not None else weight.new_zeros(n) for b, n in zip(biases, rows)])
    return weight, bias


def _projection(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, owner: Any) -> Projection:
    return Projection(weight.detach(), None if bias is None else bias.detach(),
                      _pack(weight.detach(), owner) if pack else None)


def _pack(weight: torch.Tensor, owner: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """oneDNN's blocked copy of ``weight``, cached on ``owner`` (the nn.Linear whose weight starts it)
    while that weight is the same tensor, unwritten: views share their base's version counter."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    # Inference tensors keep no version counter: they cannot be written outside inference mode anyway.
    version = -1 if owner.weight.is_inference() else owner.weight._version
    stamp = (weight.data_ptr(), weight.shape, version)
    hit = getattr(owner, _PACKED_ATTR, None)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        half = weight.shape[1] // 2
        packed = tuple(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)
                       for w in (weight[:, :half], weight[:, half:]))
    except RuntimeError:  # an oneDNN build without this layout: the dense weight still works
        return None
    object.__setattr__(owner, _PACKED_ATTR, (stamp, packed))  # a plain attribute: not a parameter or buffer
    return packed


def layer_weights(layer: Any, *, pack: bool) -> LayerWeights:
    """The fused (and, with ``pack``, prepacked) projections of a Llama-shaped decoder layer."""
    a, mlp = layer.self_attn, layer.mlp
    with torch.inference_mode(False):  # the model's new parameters must stay ordinary tensors
        qkv = _fused([a.q_proj, a.k_proj, a.v_proj])
        gate_up = _fused([mlp.gate_proj, mlp.up_proj])
    return LayerWeights(
        qkv=_projection(*qkv, pack, a.q_proj),
        o=_projection(a.o_proj.weight, a.o_proj.bias, pack, a.o_proj),
        gate_up=_projection(*gate_up, pack, mlp.gate_proj),
        down=_projection(mlp.down_proj.weight, mlp.down_proj.bias, pack, mlp.down_proj),
    )


def rms_norm(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's RMSNorm as one fused ``F.rms_norm`` call (bit-identical in fp32, one kernel instead
    of seven per norm, 61 norms a step for SmolLM2); the module itself for other norms and dtypes."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    plain = type(norm).__name__.endswith("RMSNorm") and not type(norm).__name__.startswith("Gemma")
    if not plain or weight is None or eps is None or weight.dtype != torch.float32 or weight.dim() != 1:
        return norm
    shape, w = (weight.shape[0],), weight.detach()
    return lambda x: F.rms_norm(x, shape, w, eps) if x.dtype == torch.float32 else norm(x)


def lm_head_weights(lm_head: Any, *, pack: bool) -> Projection:
    return _projection(lm_head.weight, lm_head.bias, pack, lm_head)
