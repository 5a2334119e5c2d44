"""A decode step's layers in one compiled call, for plain Llama models on CPU.

On the torch path a bf16 SmolLM2 decode step at batch 1 spends as long in the glue between its products
as in the products: ~60 small torch ops a layer (norms, rotations, dtype conversions, the SwiGLU product,
residuals, the attention's gathers and softmax), each a few microseconds. ``decode_layer.c`` does a layer's glue in a few
passes over rows of a few hundred floats: RMSNorm, the q/k/v product, RoPE, the new K/V into the
cache's arena where the cache's store plan puts them (``PagedKVCache.store_rows``; the runner then
books them with ``stored``, so digests are the cache's as always), attention over the layer's paged
K/V, the o product, residual, RMSNorm, the gate/up product, SiLU, the down product, residual; every
layer of the step in one call (a call per half-layer would cost ~0.5 ms a step in ctypes and Python). It
computes what the torch path computes, rounding bf16 where torch's bf16 ops round (see the C file);
it hands back each row's newest-query scores and probabilities, so attention statistics see what
attention used.

It applies to a step whose rows are all decode rows over K/V the cache holds in the model's dtype,
with no step feature that changes attention (``engine.features.protocol``) nor the attention-nan fault's hook,
and a store the cache lets it do, and to models
whose layers are plain Llama layers in float32 or bfloat16 (no q/k norms, no biases, SiLU); elsewhere
the runner's torch path runs.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ... import knobs
from ..kernels import native, pool
from .attention import AttnStats, Newest
from .matvec import MAX_ROWS
from .weights import LayerWeights

__all__ = ["DecodeLayers", "DecodeStep", "KernelMismatch"]

_SOURCE = native.source("decode_layer.c")
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# the kernel's statistics arguments: head scratch, sink, summary, per-head entropy and largest score, counts
_StatsArgs = tuple[int | None, int, int | None, int | None, int | None, int | None]
_UNIT_STEPS = 64  # steps of digest unit sums per buffer (DecodeLayers.units)
_MODEL_TYPES = {"llama", "mistral"}  # layers exactly Llama's: pre-norms, no q/k norms, no multipliers


class _Args(ctypes.Structure):
    """The kernel's one argument, ``decode_args`` in decode_layer.h (which decode_layer.c says the meaning of),
    field for field; ``_kernel`` checks that the library was built with this layout."""

    _fields_ = [(name, _I64) for name in ("is_bf16", "L", "M", "hidden", "H", "Hkv", "D", "I")] + [
        (name, _PTR) for name in ("layers", "kv", "x", "qkv", "cos", "sin", "rows", "kv_rows")] + [
        ("nb", _I64), ("bs", _I64), ("lens", _PTR), ("newest", _PTR), ("keep", _I64), ("T", _I64),
        ("heads", _PTR), ("sink", _I64)] + [
        (name, _PTR) for name in ("summary", "hent", "hmax", "counts", "wk", "wv", "units", "mix")] + [
        ("U", _I64), ("shares", _PTR), ("vblock", _PTR), ("vk", _I64)] + [
        (name, _PTR) for name in ("vsums", "vtotal", "final_w", "scratch")] + [
        ("final_eps", ctypes.c_double), ("threads", _I64)]


class KernelMismatch(RuntimeError):
    """The compiled kernel's argument struct is laid out otherwise than ``_Args``: calling it would crash."""


def check_layout(lib: Any) -> None:
    """Raise ``KernelMismatch`` unless ``lib``'s ``decode_args`` has ``_Args``' fields, offsets and size."""
    lib.kvdoctor_decode_args_names.restype = ctypes.c_char_p
    lib.kvdoctor_decode_args_layout.restype = ctypes.POINTER(_I64)
    theirs = lib.kvdoctor_decode_args_names().decode().split()
    layout = lib.kvdoctor_decode_args_layout()
    count = layout[0]
    size, offsets = layout[1], [layout[2 + i] for i in range(count)]
    ours = [name for name, _ in _Args._fields_]
    mine = [getattr(_Args, name).offset for name in ours]
    if theirs != ours or offsets != mine or size != ctypes.sizeof(_Args):
        raise KernelMismatch(
            f"decode_layer.h's decode_args ({count} fields, {size} bytes) does not match decode_layer.py's _Args "
            f"({len(ours)} fields, {ctypes.sizeof(_Args)} bytes): fields "
            + ", ".join(f"{a}@{x} != {b}@{y}" for a, x, b, y in zip(theirs, offsets, ours, mine) if (a, x) != (b, y))
            + (f"; theirs only: {theirs[len(ours):]}" if len(theirs) > len(ours) else "")
            + (f"; ours only: {ours[len(theirs):]}" if len(ours) > len(theirs) else ""))


@functools.cache
def _kernel() -> Any:
    """The compiled ``kvdoctor_decode_layers``, its layout checked; None where it cannot run here."""
    lib = native.load(_SOURCE, {"kvdoctor_decode_layers": [ctypes.POINTER(_Args)],
                                "kvdoctor_decode_args_layout": [], "kvdoctor_decode_args_names": []})
    if isinstance(lib, str):
        return None
    check_layout(lib)
    return lib.kvdoctor_decode_layers


class _LayerC(ctypes.Structure):
    """One layer's weights as the C side reads them (``layer_weights`` in decode_layer.c)."""

    _fields_ = [(name, _PTR) for name in ("norm1", "qkv", "o", "norm2", "gate_up", "down")] + [
        (name, _F32) for name in ("eps1", "eps2", "scale")]


def _norm(norm: Any, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
    """The weight and eps of a plain RMSNorm in ``dtype`` (transformers' Llama norm or ours)."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    plain = type(norm).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "RMSNorm")
    if not plain or w is None or eps is None or w.dtype != dtype or w.dim() != 1 or not w.is_contiguous():
        return None
    return w.detach(), float(eps)


class DecodeLayers:
    """The compiled layers of one model; ``for_model`` says None where they do not apply.

    The weights' addresses are read once; ``_tensors`` keeps what they point into alive (the runner's
    projections and norms hold the same tensors: a parameter replaced later is read by neither)."""

    def __init__(self, layers: list[_LayerC], tensors: list[torch.Tensor], dims: tuple[int, int, int, int, int],
                 dtype: torch.dtype, kernel: Any, final: tuple[torch.Tensor, float] | None = None) -> None:
        self.num_layers = len(layers)
        self._table = (_LayerC * len(layers))(*layers)
        self._tensors = tensors + ([final[0]] if final is not None else [])
        # the final norm's weight and eps: the kernel leaves x normalised for the lm head (``DecodeStep.normed``)
        self._final = (final[0].data_ptr(), final[1]) if final is not None else (None, 0.0)
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate = dims
        self.dtype = dtype
        self._kernel = kernel
        self._held: dict[tuple, Any] = {}  # buffers a step fills and reads (held)
        self._addresses: dict[int, tuple[np.ndarray, int]] = {}  # arrays steps only read (address)
        self._units: dict[int, list[Any]] = {}  # rows -> [chunk of steps' unit sums, its address, steps used]

    def address(self, a: np.ndarray) -> int:
        """The address of an array that lives as long as the model's cache and is never replaced (the digests'
        weights), looked up once."""
        got = self._addresses.get(id(a))
        if got is None or got[0] is not a:
            got = self._addresses[id(a)] = (a, a.ctypes.data)
        return got[1]

    def held(self, key: tuple, make: Callable[[], Any]) -> Any:
        """What ``make`` gives for ``key``, made once and kept: buffers a step fills and that are read before the
        next step runs, with their addresses and views. Each allocation, view and address lookup costs 10-50 us
        after a step has streamed the weights through the caches, and a listened step needed half a dozen."""
        got = self._held.get(key)
        if got is None:
            got = self._held[key] = make()
        return got

    def units(self, M: int) -> tuple[np.ndarray, int]:
        """A step's ``(L, M)`` buffer of digest unit sums, and its address: a view of a chunk of steps, never
        reused (a block's record keeps its step's until a verification looks: ``digest.BlockRecord.book``)."""
        ring = self._units.get(M)
        if ring is None or ring[2] == _UNIT_STEPS:
            chunk = np.empty((_UNIT_STEPS, self.num_layers, M), dtype=np.int64)
            ring = self._units[M] = [chunk, chunk.ctypes.data, 0]
        chunk, at, i = ring
        ring[2] = i + 1
        return chunk[i], at + i * self.num_layers * M * 8

    @classmethod
    def for_model(cls, model: Any, modules: Sequence[Any], weights: Sequence[LayerWeights]) -> DecodeLayers | None:
        """For a plain Llama model on CPU in float32 or bf16 whose projections run on the matvec kernel
        (``KVDOCTOR_DECODE_LAYER=0`` switches them off: the torch path, as for a benchmark's A/B)."""
        if not knobs.get(knobs.DECODE_LAYER):
            return None
        cfg = model.config
        param = next(model.parameters())
        H, H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        if (cfg.model_type not in _MODEL_TYPES or param.device.type != "cpu"
                or param.dtype not in (torch.float32, torch.bfloat16) or getattr(cfg, "hidden_act", "silu") != "silu"
                or D % 8 or D > 256 or H % H_kv or H // H_kv > 8):  # decode_layer.c: D_MAX, G_MAX
            return None
        kernel = _kernel()
        if kernel is None:
            return None
        layers, tensors = [], []
        for module, w in zip(modules, weights):
            a = module.self_attn
            projections = (w.qkv, w.o, w.gate_up, w.down)
            if hasattr(a, "q_norm") or any(p.matvec is None or p.bias is not None for p in projections):
                return None
            n1, n2 = _norm(module.input_layernorm, param.dtype), _norm(module.post_attention_layernorm, param.dtype)
            if n1 is None or n2 is None or type(module.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
                return None
            qkv, o, gate_up, down = (p.weight for p in projections)
            layers.append(_LayerC(n1[0].data_ptr(), qkv.data_ptr(), o.data_ptr(), n2[0].data_ptr(),
                                  gate_up.data_ptr(), down.data_ptr(), n1[1], n2[1], float(a.scaling)))
            tensors += [n1[0], n2[0], qkv, o, gate_up, down]
        intermediate = weights[0].gate_up.weight.shape[0] // 2
        return cls(layers, tensors, (cfg.hidden_size, H, H_kv, D, intermediate), param.dtype, kernel,
                   _norm(model.model.norm, param.dtype))

    def step(self, kv_lens: Sequence[int], kv_rows: torch.Tensor, blocks: int, block_size: int,
             store_rows: torch.Tensor, scores: bool, sink: int | None = None, per_head: bool = False,
             digest_weights: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> DecodeStep | None:
        """The buffers of one decode step over rows with ``kv_lens`` keys (None above ``MAX_ROWS`` rows), whose
        new K/V go to ``store_rows``; with ``scores`` each layer keeps its rows' newest-query scores and
        probabilities; with ``sink`` (the keys that count as the attention sink) the step's ``stats`` hold
        every layer's and row's attention statistics (each head's too with ``per_head``); with
        ``digest_weights`` (the cache's: of K, of V, of a record's columns) its ``units`` the digest unit sums of
        the new K/V and its ``shares`` each token's share of a record's digest at every column."""
        M = len(kv_lens)
        if M > MAX_ROWS:
            return None
        return DecodeStep(self, M, max(kv_lens), torch.tensor(kv_lens, dtype=torch.int32), kv_rows, blocks,
                          block_size, store_rows, scores, sink, per_head, digest_weights)


def _with_address(a: np.ndarray) -> tuple[np.ndarray, int]:
    return a, a.ctypes.data


def _stats_buffers(L: int, M: int, H: int, per_head: bool, sink: int
                   ) -> tuple[AttnStats, _StatsArgs, np.ndarray]:
    """A step's statistics over M rows, and the kernel's arguments for them: head scratch, sink, summary,
    per-head entropy and largest score, the non-finite counts as integers."""
    heads, summary = np.empty((L, M, H, 4), np.float32), np.empty((L, M, 4), np.float32)  # Head: attn_stats.c's
    per = [np.empty((L, M, H), np.float32) for _ in range(2)] if per_head else []
    counts = np.empty((L, M), np.int64)
    stats = AttnStats(torch.from_numpy(summary), *(torch.from_numpy(a) for a in per), host=summary, counts=counts)
    args = (heads.ctypes.data, sink, summary.ctypes.data, *(a.ctypes.data for a in per), *(None,) * (2 - len(per)),
            counts.ctypes.data)
    return stats, args, heads  # the scratch kept alive with its address


class DecodeStep:
    """One step's buffers: q/k/v of every layer, float scratch,
    the scores and probabilities attention leaves (every layer's, or one reused), the attention statistics
    of every layer and row (``stats``) when a ``sink`` is given, and the new K/V's digest unit sums
    (``units``, (L, M)) and digest shares (``shares``, (M, U)) when digest weights are."""

    def __init__(self, layers: DecodeLayers, M: int, T: int, lens: torch.Tensor, kv_rows: torch.Tensor,
                 blocks: int, block_size: int, store_rows: torch.Tensor, keep_scores: bool, sink: int | None,
                 per_head: bool, digest_weights: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> None:
        L = layers
        H, H_kv, D, hidden, inter = L.heads, L.kv_heads, L.head_dim, L.hidden, L.intermediate
        self.L, self.M, self.T, self.lens, self.kv_rows, self.store_rows = L, M, T, lens, kv_rows, store_rows
        self.blocks, self.block_size, self.keep_scores = blocks, block_size, keep_scores
        self.qkv = torch.empty(L.num_layers, M, (H + 2 * H_kv) * D, dtype=L.dtype)
        widest = max(inter, hidden, H * D)
        self.scratch = torch.empty(M * (H * D + 2 * inter + 2 * widest + 2 * hidden + self.qkv.shape[-1]))
        self.newest = torch.empty(L.num_layers if keep_scores else 1, 2, M, H, T)
        self.stats: AttnStats | None = None
        self._stats_args: _StatsArgs = (None, 0, None, None, None, None)
        if sink is not None:  # the statistics leave for Python within the step (``AttnStats.fields``)
            self.stats, self._stats_args, _ = L.held(("stats", M, per_head, sink),
                                                     lambda: _stats_buffers(L.num_layers, M, H, per_head, sink))
        self._weights = digest_weights
        self._verify: np.ndarray | None = None  # (M, K) the blocks run verified, -1 padding (verified)
        self.units = self.shares = None
        if digest_weights is not None:
            self.units, self._units_at = L.units(M)
            self.shares, self._shares_at = L.held(("shares", M, digest_weights[2].shape[1]),
                                                  lambda: _with_address(np.empty((M, digest_weights[2].shape[1]), np.uint64)))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Sequence[torch.Tensor],
            verify: Sequence[Sequence[int]] | None = None) -> Newest | None:
        """Every layer for ``x`` (M, hidden), in place (normalised by the final norm after, when ``normed``), over
        the layers' arenas ``kv`` (``layer_kv``); every
        layer's rows' newest-query scores and probabilities, (L, M, H, T) each, when the step keeps them.
        ``verify``: each row's blocks (indices into its table) whose digests attention takes over the bytes it
        reads (a sampled read's verification, ``PagedKVCache.sample_reads``: every pick, so the sweep's bound
        holds here as on the torch path), by the digest weights: ``verified`` hands them back."""
        L = self.L
        self._verify = None
        if verify is not None and self._weights is not None and any(verify):
            K = max(len(p) for p in verify)
            self._verify = np.full((self.M, K), -1, np.int64)
            for row, picks in zip(self._verify, verify):
                row[: len(picks)] = picks
        arenas = (_PTR * L.num_layers)(*(a.data_ptr() for a in kv))
        heads, sink, summary, hent, hmax, counts = self._stats_args
        wk, wv, units, mix, U, shares = self._digest_pointers()
        vblock, vsums, vtotal = self._verify_pointers()
        args = _Args(is_bf16=int(L.dtype == torch.bfloat16), L=L.num_layers, M=self.M, hidden=L.hidden, H=L.heads,
                     Hkv=L.kv_heads, D=L.head_dim, I=L.intermediate, layers=ctypes.addressof(L._table),
                     kv=ctypes.addressof(arenas), x=x.data_ptr(), qkv=self.qkv.data_ptr(), cos=cos.data_ptr(),
                     sin=sin.data_ptr(), rows=self.store_rows.data_ptr(), kv_rows=self.kv_rows.data_ptr(),
                     nb=self.blocks, bs=self.block_size, lens=self.lens.data_ptr(), newest=self.newest.data_ptr(),
                     keep=int(self.keep_scores), T=self.T, heads=heads, sink=sink, summary=summary, hent=hent,
                     hmax=hmax, counts=counts, wk=wk, wv=wv, units=units, mix=mix, U=U, shares=shares, vblock=vblock,
                     vk=0 if self._verify is None else self._verify.shape[1], vsums=vsums, vtotal=vtotal, final_w=L._final[0], scratch=self.scratch.data_ptr(),
                     final_eps=L._final[1], threads=pool.team())
        L._kernel(ctypes.byref(args))
        return Newest(self.newest[:, 0], self.newest[:, 1]) if self.keep_scores else None

    def _verify_pointers(self) -> tuple[int | None, int | None, int | None]:
        """The kernel's verification arguments: each row's blocks, the shares out, the digests out."""
        if self._verify is None:
            return None, None, None
        L, (M, K) = self.L, self._verify.shape
        (block, block_at), (self._vtotal, total_at), (_, sums_at) = L.held(("verify", M, K), lambda: (
            _with_address(np.empty((M, K), np.int64)), _with_address(np.empty((M, K), np.uint64)),
            _with_address(np.empty((L.num_layers, M, K, L.kv_heads), np.uint64))))
        block[:] = self._verify
        return block_at, sums_at, total_at

    @property
    def normed(self) -> bool:
        """Whether ``run`` leaves ``x`` normalised by the model's final norm (a plain RMSNorm), ready for the lm head."""
        return self.L._final[0] is not None

    def verified(self, row: int) -> list[tuple[int, int]]:
        """``(block index, digest)`` of each of row ``row``'s blocks that ``run`` verified (none: empty)."""
        if self._verify is None:
            return []
        return [(int(j), int(d)) for j, d in zip(self._verify[row], self._vtotal[row]) if j >= 0]

    def _digest_pointers(self) -> tuple[int | None, int | None, int | None, int | None, int, int | None]:
        """The kernel's digest arguments: the weights of K and V, the unit sums out, the columns' weights and
        their count, the shares out."""
        if self._weights is None:  # (units and shares are made exactly when there are weights)
            return None, None, None, None, 0, None
        wk, wv, mix = self._weights
        L = self.L
        return L.address(wk), L.address(wv), self._units_at, L.address(mix), mix.shape[1], self._shares_at
