"""The runner's projections: q/k/v and gate/up fused into one matmul each, few rows by a C kernel on CPU.

A decode step multiplies a handful of rows by every weight of the model, so its time
goes to many small matmuls, bound by how fast the weights stream from memory. Three things
make them cheaper without changing what they compute:

- **Fusion.** The q, k and v projections read the same input, as do gate and up: one
  matmul over the concatenated weight replaces three (two) calls. The fused weight is built
  once and the model's ``nn.Linear`` weights become views into it, so memory holds one copy.
- **A bandwidth-bound kernel.** Up to ``matvec.MAX_ROWS`` rows on CPU go to ``matvec`` (each
  weight read once, split over the kernels' thread pool, faster than MKL's and oneDNN's float32 products at
  these row counts: docs/benchmarks.md; bf16 weights at half the bytes); more rows (prefill) to ``F.linear`` (MKL's
  GEMM; a bf16 weight on CPU widened to float32 for it, as torch's bf16 GEMM is slower there).
- **2 MB pages.** Every projection's weight is copied once into an arena of huge pages (``hugepages``),
  where the OS gives them, so streaming the weights does not walk a page table every 4 KB.

The kernel sums in a different order than MKL, so logits differ from transformers' in the
last bits (well inside the 1e-4 the tests allow); the greedy tokens are the same.
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

from .hugepages import Arena, give_back, holds
from .matvec import DTYPES, MAX_ROWS, Matvec

__all__ = ["Projection", "LayerWeights", "PageOut", "model_weights", "rms_norm"]

_MADV_DONTNEED = 4  # unmap these pages: a private file mapping maps the file's pages again on the next read


@dataclass(frozen=True)
class Projection:
    """``x @ weight.T + bias`` for ``x`` (M, K): by the C kernel for few rows when there is one."""

    weight: torch.Tensor  # (N, K) fused dense weight, shared with the model's Linears
    bias: torch.Tensor | None  # (N,)
    matvec: Matvec | None  # None: F.linear for every row count (other devices and dtypes, no compiler)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.matvec is not None and x.shape[0] <= MAX_ROWS:
            return self.matvec(x, self.weight, self.bias).to(x.dtype)  # (M, N)
        if self.weight.dtype == torch.bfloat16 and self.weight.is_cpu:
            # Many rows (prefill) of a bf16 weight: torch's bf16 GEMM on a CPU without bf16 arithmetic is
            # ~3x slower than widening the weight for the float32 GEMM (800 rows x SmolLM2's gate/up: 279 vs
            # 84 ms); the sums are float32 either way, the result rounded to bf16 as the bf16 product rounds it.
            bias = self.bias.float() if self.bias is not None else None
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)  # (M, N)
        return F.linear(x, self.weight, self.bias)  # (M, N)

    def floats(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``: by the kernel, rounded to x's dtype's values in the same pass where that is bf16
        (no bf16 tensor and conversion back: 0.38 ms for SmolLM2's logits at batch 8, read cold)."""
        if self.matvec is not None and x.shape[0] <= MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
            return self.matvec(x, self.weight, self.bias, round_bf16=x.dtype == torch.bfloat16)
        return self(x).float()


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's projections as the runner calls them."""

    qkv: Projection  # (H + 2 H_kv) * D outputs: q, then k, then v
    o: Projection
    gate_up: Projection  # 2 * intermediate outputs: gate, then up
    down: Projection


class PageOut:
    """Drops the pages of dense weights that are mapped from a file out of this process.

    transformers maps a safetensors checkpoint privately and its tensors are views of that mapping,
    which stays mapped while any of them lives: once q/k/v (gate/up) are copied into one fused weight,
    the pages read for the copy only hold what the file holds, and nothing reads them again. ``MADV_DONTNEED``
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


def _in_place(weights: list[torch.Tensor], huge: bool) -> bool:
    """Whether ``weights`` already lie one after another in one storage (a second runner on the same model), and
    with ``huge`` in an arena of 2 MB pages: then their fused weight is a view, no copy."""
    base = weights[0]
    if huge and base.is_cpu and not holds(base):
        return False
    storage, at = base.untyped_storage().data_ptr(), base.storage_offset()
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != storage or w.storage_offset() != at:
            return False
        at += w.numel()
    return True


def _copy_bytes(modules: list[Any]) -> int:
    """The bytes ``modules``' fused weight takes in an arena, 0 when it stays where it is. (It holds no weight
    after: each layer's old weights must be freed as soon as its copies are made.)"""
    weights = [m.weight for m in modules]
    if not weights[0].is_cpu or _in_place(weights, True):
        return 0
    return sum(w.numel() * w.element_size() for w in weights)


def _fused(modules: list[Any], pager: PageOut | None, arena: Arena | None, tied: tuple[Any, ...] = ()
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (sum N, K) over ``modules`` (nn.Linear), in ``arena`` when there is one; their parameters
    (and those of ``tied`` modules that share one of them: an input embedding tied to the lm head) become
    views into it, and the pages of the weights they held, where those are a mapped checkpoint's, are
    dropped by ``pager``.

    A second runner on the same model finds the views already in place (in an arena) and reuses them."""
    weights = [m.weight for m in modules]
    base = weights[0]
    rows = [w.shape[0] for w in weights]
    if _in_place(weights, arena is not None):
        weight = base.detach().as_strided((sum(rows), base.shape[1]), (base.shape[1], 1), base.storage_offset())
    else:
        out = arena.take((sum(rows), base.shape[1]), base.dtype) if arena is not None and base.is_cpu else None
        weight = torch.cat([w.detach() for w in weights], out=out)  # (sum N, K)
        for m, w, old in zip(modules, weight.split(rows), weights):
            new = torch.nn.Parameter(w, requires_grad=False)
            for holder in (m, *tied):
                held = getattr(holder, "weight", None)
                if held is old or (isinstance(held, torch.Tensor) and held.data_ptr() == old.data_ptr()
                                   and held.shape == old.shape):
                    holder.weight = new
        if pager is not None:
            pager.release([w.detach() for w in weights])
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([b.detach() if b is not None else weight.new_zeros(n) for b, n in zip(biases, rows)])


def _projection(modules: list[Any], matvec: Matvec | None, pager: PageOut | None, arena: Arena | None,
                tied: tuple[Any, ...] = ()) -> Projection:
    """The fused product of ``modules``; the kernel only where it computes what ``F.linear`` would
    (a float32 or bfloat16 contiguous weight on CPU)."""
    with torch.inference_mode(False):  # the model's new parameters must stay ordinary tensors
        weight, bias = _fused(modules, pager, arena, tied)
    weight = weight.detach()
    usable = weight.device.type == "cpu" and weight.dtype in DTYPES and weight.is_contiguous()
    return Projection(weight, bias, matvec if usable else None)


def _layer_groups(layer: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """A Llama-shaped decoder layer's Linears as the projections fuse them: q/k/v, o, gate/up, down."""
    a, mlp = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


def model_weights(layers: list[Any], lm_head: Any, embedding: Any = None, *, matvec: Matvec | None = None,
                  pager: PageOut | None = None) -> tuple[list[LayerWeights], Projection]:
    """The fused projections of Llama-shaped decoder ``layers`` and the ``lm_head``, few rows by ``matvec``
    when given, every weight on 2 MB pages where the OS gives them (``hugepages``: copied there once, the
    model's Linears and a tied input ``embedding`` made views of the copies); with a ``pager``, the
    checkpoint's pages of the weights copied are dropped (see ``PageOut``)."""
    groups = [_layer_groups(layer) for layer in layers]
    arena = Arena.sized([n for mods in [*(mods for g in groups for mods in g), [lm_head]] if (n := _copy_bytes(mods))])
    built = []
    for g in groups:
        built.append(LayerWeights(*(_projection(mods, matvec, pager, arena) for mods in g)))
        if arena is not None:
            give_back()  # the layer's old weights, before the next layer's copies fault their pages in
    head = _projection([lm_head], matvec, pager, arena, (embedding,) if embedding is not None else ())
    if arena is not None:
        give_back()
    return built, head


def rms_norm(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's RMSNorm as one fused ``F.rms_norm`` call (bit-identical in fp32, one kernel instead
    of seven per norm, 61 norms a step for SmolLM2); the module itself for other norms and dtypes."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    plain = type(norm).__name__.endswith("RMSNorm") and not type(norm).__name__.startswith("Gemma")
    if not plain or weight is None or eps is None or weight.dtype != torch.float32 or weight.dim() != 1:
        return norm
    shape, w = (weight.shape[0],), weight.detach()
    return lambda x: F.rms_norm(x, shape, w, eps) if x.dtype == torch.float32 else norm(x)
