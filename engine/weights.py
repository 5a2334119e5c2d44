"""The runner's projections: q/k/v and gate/up fused into one matmul each, and prepacked for oneDNN on CPU.

A decode step multiplies a handful of rows by every weight of the model, so its time
goes to many small matmuls. Two things make them cheaper without changing what they
compute:

- **Fusion.** The q, k and v projections read the same input, as do gate and up: one
  matmul over the concatenated weight replaces three (two) calls.
- **Prepacking.** PyTorch's CPU ``linear`` calls MKL, whose GEMM for a few rows against
  a wide weight runs far below the core's peak on the AMD machines we measure on (a
  batch of eight takes about four times as long as one row). oneDNN with the weight
  reordered once into its blocked layout runs the same product 1.5-3x faster from two
  rows up, and one row about as fast as MKL's GEMV in the runner's decode step.

**One copy of the weights.** A packed projection computes every row count from its packed
copy, so the runner never reads the model's dense weights again: they are left as they are
(no fused dense copy is made; the packed copy is built from a temporary concatenation) and,
where they are pages of the checkpoint file that transformers mapped, those pages are handed
dropped from the process once packed (``PageOut``: the Hugging Face model still computes with
them, mapping them again from the file when it runs). So the
process holds the linear weights once, packed. Without packing (``pack=False``, other devices,
dtypes oneDNN cannot pack) the fused weight is built once and the model's ``nn.Linear``
weights become views into it, so there too memory is not doubled.

Both reorder floating-point sums, so logits differ from transformers' in the last bits
(well inside the 1e-4 the tests allow); the greedy tokens are the same.
"""

from __future__ import annotations

import array
import ctypes
import mmap
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["Projection", "LayerWeights", "PageOut", "layer_weights", "lm_head_weights", "rms_norm"]

# Attribute of the model's nn.Linear (the first of a fused group) that keeps its packed copy, so every
# runner on the same model shares one, and it goes with the model.
_PACKED_ATTR = "_kvdoctor_packed"
_MADV_DONTNEED = 4  # unmap these pages: a private file mapping maps the file's pages again on the next read


@dataclass(frozen=True)
class Projection:
    """``x @ weight.T + bias`` for ``x`` (M, K), from oneDNN's prepacked copy of ``weight`` when there is one.

    The packed copy is split along K in two halves whose products are added: oneDNN accumulates each
    output along K in one running sum, which on its own drifts from MKL's result about twice as far
    (SmolLM2's logits then leave transformers' by more than 1e-4); two half sums match MKL's error
    for about 10% more time."""

    weight: torch.Tensor | None  # (N, K) fused dense weight; None when packed (the runner never reads it then)
    bias: torch.Tensor | None  # (N,)
    packed: tuple[torch.Tensor, torch.Tensor] | None  # oneDNN layouts of weight[:, :K/2] and weight[:, K/2:]
    shape: tuple[int, int]  # (N, K)
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            lo, hi = self.packed
            k = lo.shape[1]
            y = torch.ops.mkldnn._linear_pointwise(x[:, :k], lo, self.bias, "none", [], "")  # (M, N)
            return y.add_(torch.ops.mkldnn._linear_pointwise(x[:, k:], hi, None, "none", [], ""))
        return F.linear(x, self.weight, self.bias)  # (M, N)

    @property
    def nbytes(self) -> int:
        """Bytes of weights one product reads (the dense size; the packed copy holds the same values)."""
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's projections as the runner calls them."""

    qkv: Projection  # (H + 2 H_kv) * D outputs: q, then k, then v
    o: Projection
    gate_up: Projection  # 2 * intermediate outputs: gate, then up
    down: Projection


class PageOut:
    """Drops the pages of dense weights that are mapped from a file out of this process.

    transformers maps a safetensors checkpoint privately and its tensors are views of that mapping:
    once the runner has its packed copy, those pages only hold what the file holds. ``MADV_DONTNEED``
    unmaps them (the next read, by the Hugging Face model, maps them again from the page cache or the
    disk), so the process keeps one copy of the weights. A page written since it was mapped is this
    process's own copy, which ``MADV_DONTNEED`` would throw away: a range with such a page (or a page
    swapped out) is left alone, as is anonymous memory (a model built in memory). The mappings are
    read once, when this is built; the pages' state (``/proc/self/pagemap``) at each release."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []
        self._madvise: Any = None
        if not sys.platform.startswith("linux"):
            return
        try:
            with open("/proc/self/maps") as fh:
                for line in fh:
                    fields = line.split()
                    # a private mapping of a file (inode not 0), not anonymous memory
                    if len(fields) >= 6 and fields[5].startswith("/") and fields[4] != "0" and fields[1][3] == "p":
                        start, end = (int(a, 16) for a in fields[0].split("-"))
                        self._ranges.append((start, end))
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise = libc.madvise
        except (OSError, AttributeError, ValueError):  # no /proc or no madvise: nothing is dropped
            self._ranges = []

    def release(self, tensors: list[torch.Tensor]) -> int:
        """Drop the whole pages of ``tensors`` that lie in a file mapping, unwritten; the bytes dropped."""
        released = 0
        for t in tensors:
            if self._madvise is None or t.device.type != "cpu":
                continue
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            if not any(lo <= start and end <= hi for lo, hi in self._ranges):
                continue
            lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo and _file_pages_only(lo, hi) and self._madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                released += hi - lo
        return released


def _file_pages_only(lo: int, hi: int) -> bool:
    """Whether every page in [lo, hi) is either not in memory (and not swapped) or the file's own page:
    ``/proc/self/pagemap`` has a 64-bit entry per page, bit 63 present, 62 swapped, 61 file page."""
    num_pages = (hi - lo) // mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as fh:
            fh.seek(lo // mmap.PAGESIZE * 8)
            entries = array.array("Q", fh.read(num_pages * 8))
    except OSError:
        return False
    present, swapped, file_page = 1 << 63, 1 << 62, 1 << 61
    return len(entries) == num_pages and all(not e & swapped and (not e & present or e & file_page) for e in entries)


def _fused(modules: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (sum N, K) over ``modules`` (nn.Linear); their parameters become views into it.

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
    return weight, _fused_bias(modules, rows, weight)


def _fused_bias(modules: list[Any], rows: list[int], like: torch.Tensor) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else like.new_zeros(n) for b, n in zip(biases, rows)])


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _pack(modules: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """oneDNN's blocked copy of the weights of ``modules`` side by side (sum N, K), cached on the first
    module while its weights are the same tensors, unwritten. The dense concatenation is a temporary."""
    weights = [m.weight.detach() for m in modules]
    # Inference tensors keep no version counter: they cannot be written outside inference mode anyway.
    stamp = tuple((w.data_ptr(), w.shape, -1 if w.is_inference() else m.weight._version)
                  for w, m in zip(weights, modules))
    hit = getattr(modules[0], _PACKED_ATTR, None)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]  # (sum N, K)
    try:
        half = weight.shape[1] // 2
        packed = tuple(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)
                       for w in (weight[:, :half], weight[:, half:]))
    except RuntimeError:  # an oneDNN build without this layout (bf16 without AVX-512): the dense weight works
        return None
    object.__setattr__(modules[0], _PACKED_ATTR, (stamp, packed))  # a plain attribute: not a parameter or buffer
    return packed


def _projection(modules: list[Any], pack: bool, pager: PageOut | None) -> Projection:
    """The fused product of ``modules``: packed (the dense weights left as they are and their file pages
    dropped), or, when it cannot or should not pack, over a fused dense weight the modules share."""
    first = modules[0].weight
    shape = (sum(m.weight.shape[0] for m in modules), first.shape[1])
    packed = _pack(modules) if pack and _packable(first) else None
    if packed is not None:
        if pager is not None:
            pager.release([m.weight.detach() for m in modules])
        rows = [m.weight.shape[0] for m in modules]
        return Projection(None, _fused_bias(modules, rows, first.detach()), packed, shape, first.dtype)
    with torch.inference_mode(False):  # the model's new parameters must stay ordinary tensors
        weight, bias = _fused(modules)
    return Projection(weight.detach(), bias, None, shape, first.dtype)


def layer_weights(layer: Any, *, pack: bool, pager: PageOut | None = None) -> LayerWeights:
    """The fused (and, with ``pack``, prepacked) projections of a Llama-shaped decoder layer; with a
    ``pager``, the dense weights' file pages are dropped as each projection is packed."""
    a, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        qkv=_projection([a.q_proj, a.k_proj, a.v_proj], pack, pager),
        o=_projection([a.o_proj], pack, pager),
        gate_up=_projection([mlp.gate_proj, mlp.up_proj], pack, pager),
        down=_projection([mlp.down_proj], pack, pager),
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


def lm_head_weights(lm_head: Any, *, pack: bool, pager: PageOut | None = None) -> Projection:
    return _projection([lm_head], pack, pager)
