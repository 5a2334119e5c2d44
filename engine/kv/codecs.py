"""How a block's K and V are stored: FP32/FP16/BF16 as they are, INT8 and NF4 quantized; and the calibration INT8 needs.

A codec fixes the layout of one ``(layer, head)`` row of a block — the same row
every arena holds (see ``storage``) — and encodes tokens into it and decodes rows
back to the compute dtype. Quantized rows are bytes (``uint8``):

* ``int8`` — keys per channel, values per token, as KIVI splits them: keys have
  a few large outlier channels that are consistent across tokens, values do not.
  Key scales are static, per ``(layer, kv head, channel)``, from a calibration
  over real text, so a token is encoded on its own (no rescaling of a block when
  a later token is larger); the row holds the key codes, the value codes and one
  FP16 scale per value token. 130 bytes per token and head at ``head_dim`` 64,
  0.51x FP16.
* ``nf4`` — four bits per element, keys and values on different axes (KIVI):
  keys per channel, each channel of a group of ``NF4_KEY_TOKENS`` tokens mapped
  onto 16 uniform levels between its minimum and maximum (two FP16 numbers per
  channel and group). Keys' outliers are whole channels, so a channel's own range
  fits them; per-token groups put a quiet channel next to an outlier one and round
  it to zero (on SmolLM2, 4096 tokens of GPL-3: +2.0% perplexity for the keys per
  channel against +10.7% for per-token NF4 groups smoothed by the calibrated channel
  scale, with values exact). Values per token: rotated by a Hadamard matrix
  (orthogonal, so no error grows, and it spreads a token's large channels over all
  of them: near-Gaussian, what the NF4 levels are the quantiles of), then every
  group of ``NF4_GROUP`` channels divided by its absolute maximum and rounded to
  the nearest NormalFloat4 level (+0.1% against +1.1% unrotated). 76 bytes per
  token and head at ``head_dim`` 64 and blocks of 32 tokens or more, 0.297x FP16
  (smaller blocks hold one key group per block: 0.33x at 16 tokens).

  A key group is encoded whole: a token written into a partly filled group
  re-encodes the group from its decoded keys and the new one. While the new key is
  inside the group's range the codes do not change (the range's ends are stored
  exactly and decode back to themselves); a key outside widens the range, and the
  earlier keys are rounded again onto the coarser grid — at most half a step more
  each time. On the same 4096 tokens with every group filled one token at a time
  (all decoding, the worst case) that costs +3.3% perplexity against +2.1% for
  groups encoded whole (prefill chunks, which ``benchmarks/quality.py`` measures;
  figures in docs/quality.md).
  NF4 does not use the calibration: a key group carries its own ranges.

Calibrated key scales are rotation-invariant: RoPE rotates channel pairs
``(i, i + D/2)``, so the scale of both channels of a pair is the largest norm the
pair reached in calibration, a bound that holds at every position and not only at
those the calibration text reached.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F

from ..paths import cache_home

__all__ = [
    "CODECS",
    "NATIVE",
    "NEEDS_CALIBRATION",
    "PRECISION",
    "NF4_LEVELS",
    "NF4_GROUP",
    "Calibration",
    "Codec",
    "make_codec",
    "row_payload_bytes",
    "codec_of_dtype",
    "lossier",
    "calibrate",
    "calibration_windows",
]

NATIVE: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # codec -> torch dtype name
# Codecs whose key scales come from a calibration over real text (nf4 takes its ranges from each block's own keys).
NEEDS_CALIBRATION: tuple[str, ...] = ("int8",)
_NATIVE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
CODECS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "nf4")
# Higher is lossier: a block's codec is the lossiest one its bytes went through, and never goes back.
PRECISION: dict[str, int] = {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3, "nf4": 4}

# The 16 NormalFloat4 levels (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) scaled to [-1, 1], with an exact 0.
NF4_LEVELS: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
NF4_GROUP = 32  # value channels per absmax group: one FP16 scale per 32 four-bit codes
NF4_KEY_TOKENS = 32  # tokens per key group (at most the block): one FP16 minimum and maximum per channel
_KEY_LEVELS = 15  # keys: 16 uniform levels between a channel's minimum and maximum
_INT8_MAX = 127.0
_TINY = 1e-8  # the smallest scale: an all-zero group decodes to zeros instead of NaN


def _pair_bound(k: torch.Tensor) -> torch.Tensor:
    """(L, H, D) bound of keys ``k`` (L, H, T, D): the largest norm of each RoPE pair ``(i, i + D/2)``,
    given to both its channels (the largest magnitude, for an odd ``D``)."""
    k = k.float()
    L, H, T, D = k.shape
    if D % 2:
        return k.abs().amax(dim=2)
    m = k.view(L, H, T, 2, D // 2).norm(dim=3).amax(dim=2)  # (L, H, D/2)
    return torch.cat([m, m], dim=-1)


def codec_of_dtype(dtype: str) -> str:
    """The codec that stores ``dtype`` (``"float16"``) unchanged (``"fp16"``)."""
    return {v: k for k, v in NATIVE.items()}[dtype]


def lossier(a: str, b: str) -> str:
    """The lossier of two codecs: what a block's bytes are worth after passing through both."""
    return a if PRECISION[a] >= PRECISION[b] else b


def _nf4_group(head_dim: int) -> int:
    return math.gcd(NF4_GROUP, head_dim)


def _key_tokens(block_size: int) -> int:
    return math.gcd(NF4_KEY_TOKENS, block_size)


def row_payload_bytes(codec: str, block_size: int, head_dim: int) -> int:
    """Bytes of one ``(layer, head)`` row of a block under ``codec``, before padding to 128 bytes."""
    if codec in NATIVE:
        return 2 * block_size * head_dim * _NATIVE_BYTES[codec]
    if codec == "int8":
        return block_size * (2 * head_dim + 2)  # K codes, V codes, one FP16 scale per V token
    if codec == "nf4":
        if head_dim % 2:
            raise ValueError(f"nf4 packs two codes per byte: head_dim {head_dim} must be even")
        groups = head_dim // _nf4_group(head_dim)
        key_ranges = block_size // _key_tokens(block_size) * 2 * head_dim * 2  # FP16 min and max per channel and group
        return block_size * head_dim + key_ranges + block_size * groups * 2  # K, V codes; ranges; V absmax
    raise ValueError(f"unknown codec {codec!r}: one of {', '.join(CODECS)}")


@dataclass(frozen=True)
class Calibration:
    """Per-channel key scales of one model, measured over real text; deterministic for a given text.

    ``key_scale`` is ``(num_layers, num_kv_heads, head_dim)`` float32: the largest RoPE-pair
    norm each channel reached. ``source`` names the text (with a digest), so a stored
    calibration can be told apart from one of other text.
    """

    key_scale: torch.Tensor
    num_samples: int
    num_tokens: int
    source: str
    model: str = ""
    value_absmax: torch.Tensor | None = None  # (L, H, D): reported, not used by the codecs

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.key_scale.shape)  # type: ignore[return-value]

    @property
    def digest(self) -> str:
        """Short hash of the scales' bytes: the same text and model give the same digest."""
        return hashlib.sha256(self.key_scale.float().contiguous().numpy().tobytes()).hexdigest()[:16]

    @classmethod
    def from_keys(cls, keys: Iterable[torch.Tensor], *, source: str, model: str = "",
                  num_samples: int | None = None, values: Iterable[torch.Tensor] | None = None) -> Calibration:
        """Scales from post-RoPE keys, each ``(L, H, T, D)`` (one tensor per sample or batch; a generator
        keeps only the running maximum in memory)."""
        best: torch.Tensor | None = None
        tokens = samples = 0
        for k in keys:
            m = _pair_bound(k)
            best = m if best is None else torch.maximum(best, m)
            tokens += k.shape[2]
            samples += 1
        if best is None:
            raise ValueError("calibration needs at least one sample of keys")
        vmax = None
        for v in values or ():
            m = v.float().abs().amax(dim=2)
            vmax = m if vmax is None else torch.maximum(vmax, m)
        return cls(best.clamp_min(_TINY), num_samples if num_samples is not None else samples, tokens, source,
                   model, vmax)

    def save(self, path: str) -> None:
        """Write as safetensors (tensors plus string metadata; nothing executable to load back)."""
        from safetensors.torch import save_file

        tensors = {"key_scale": self.key_scale.contiguous()}
        if self.value_absmax is not None:
            tensors["value_absmax"] = self.value_absmax.contiguous()
        meta = {"num_samples": str(self.num_samples), "num_tokens": str(self.num_tokens), "source": self.source,
                "model": self.model, "digest": self.digest}
        save_file(tensors, path, metadata=meta)

    @classmethod
    def load(cls, path: str) -> Calibration:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            key_scale = fh.get_tensor("key_scale")
            value_absmax = fh.get_tensor("value_absmax") if "value_absmax" in fh.keys() else None
        cal = cls(key_scale, int(meta.get("num_samples", 0)), int(meta.get("num_tokens", 0)), meta.get("source", ""),
                  meta.get("model", ""), value_absmax)
        if meta.get("digest") and meta["digest"] != cal.digest:
            raise ValueError(f"{path}: calibration digest {cal.digest} does not match its metadata {meta['digest']}")
        return cal


@dataclass
class Codec:
    """Encoder and decoder of one codec for rows of ``block_size x head_dim`` tokens.

    Native codecs keep the arena in their own dtype (a row is K then V); quantized
    ones keep it in bytes, with the regions listed in ``_regions``.
    """

    name: str
    block_size: int
    head_dim: int
    compute_dtype: torch.dtype
    calibration: Calibration | None = None
    _regions: dict[str, tuple[int, int]] = field(default_factory=dict, init=False)  # name -> (byte offset, bytes)
    _scale_cache: dict[Any, torch.Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r}: one of {', '.join(CODECS)}")
        bs, D = self.block_size, self.head_dim
        if self.name == "int8":
            if self.calibration is None:
                raise ValueError("the int8 codec needs a Calibration (per-channel key scales): see codecs.calibrate")
            self._regions = {"k": (0, bs * D), "v": (bs * D, bs * D), "vs": (2 * bs * D, 2 * bs)}
        elif self.name == "nf4":
            g = D // _nf4_group(D)
            codes, ranges, scales = bs * D // 2, bs // _key_tokens(bs) * 4 * D, bs * g * 2
            self._regions = {"k": (0, codes), "kr": (codes, ranges), "v": (codes + ranges, codes),
                             "vs": (2 * codes + ranges, scales)}

    # ---- layout ----
    @property
    def native(self) -> bool:
        return self.name in NATIVE

    @property
    def arena_dtype(self) -> torch.dtype:
        return getattr(torch, NATIVE[self.name]) if self.native else torch.uint8

    @property
    def payload_bytes(self) -> int:
        return row_payload_bytes(self.name, self.block_size, self.head_dim)

    def _key_scale(self, layer: int | torch.Tensor, device: torch.device) -> torch.Tensor:
        """``(H, D)`` calibrated scale of one layer (or ``(n, H, D)`` for a tensor of layers), on ``device``."""
        if self.calibration is None:
            raise ValueError(f"the {self.name} codec needs a Calibration for its key scales")
        full = self._scale_cache.get(device)
        if full is None:
            full = self.calibration.key_scale.to(device=device, dtype=torch.float32)
            self._scale_cache[device] = full
        return full[layer]

    def _region(self, rows: torch.Tensor, name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        """A view of region ``name`` of byte rows ``(..., R)`` as ``(..., *shape)`` of ``dtype``."""
        off, n = self._regions[name]
        part = rows.narrow(-1, off, n)
        if dtype != torch.uint8:
            part = part.view(dtype)
        return part.unflatten(-1, shape)

    # ---- tokens in, rows out ----
    @property
    def key_groups(self) -> int:
        """Key groups per block (nf4 encodes keys per group of tokens); 0 for the other codecs."""
        return self.block_size // _key_tokens(self.block_size) if self.name == "nf4" else 0

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """The per-token dequantisation scales of byte rows ``(..., R)``: ``(..., block_size, width)`` FP16."""
        off, n = self._regions["vs"]
        return self._region(rows, "vs", torch.float16, self.block_size, n // self.block_size // 2)

    def write(self, rows: torch.Tensor, layer: int, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode tokens ``k``, ``v`` (N, H, D) into rows ``(P, H, R)`` of one layer at block ``blk``, offset ``off``.

        Returns what was stored, as ``digest`` counts it: per token ``(N, H, width)`` by region name, and for
        nf4 the re-encoded key groups ``"k"``/``"kr"`` ``(G, H, width)`` with their ``"groups"`` ``(G,)``
        (``blk * key_groups + group``)."""
        bs, D = self.block_size, self.head_dim
        if self.native:
            kv = rows[..., : 2 * bs * D].unflatten(-1, (2, bs, D))  # (P, H, 2, bs, D)
            kv[blk, :, 0, off] = k.to(rows.dtype)
            kv[blk, :, 1, off] = v.to(rows.dtype)
            return {"k": k, "v": v}
        if self.name == "nf4":
            stored = self._write_nf4_keys(rows, blk, off, k)
            vc, vs = _nf4_encode(_rotate(v.float()), _nf4_group(D))  # (N, H, D/2), (N, H, G)
            self._region(rows, "v", torch.uint8, bs, D // 2)[blk, :, off] = vc
            self._region(rows, "vs", torch.float16, bs, vs.shape[-1])[blk, :, off] = vs
            return {**stored, "v": vc, "vs": vs}
        parts = self.encode(k[:, :, None], v[:, :, None], torch.full_like(blk, layer))  # each (N, H, 1, ...)
        for name, val in parts.items():
            dst = self._region(rows, name, val.dtype, bs, val.shape[-1])  # (P, H, bs, width)
            dst[blk, :, off] = val[:, :, 0]
        return {name: val[:, :, 0] for name, val in parts.items()}

    def _write_nf4_keys(self, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
        """Keys ``k`` (N, H, D) into their key groups: each group a token lands in is decoded, gets the new
        keys, and is encoded again over the tokens it holds (up to the newest one written). Returns the
        groups as stored (see ``write``)."""
        bs, D = self.block_size, self.head_dim
        tg = _key_tokens(bs)
        P, H = rows.shape[:2]
        codes = self._region(rows, "k", torch.uint8, bs // tg, tg, D // 2)  # (P, H, n_tg, tg, D/2)
        ranges = self._region(rows, "kr", torch.float16, bs // tg, 2, D)  # (P, H, n_tg, 2, D)
        group = blk * (bs // tg) + off // tg  # (N,) the key group of each token, numbered over the arena
        uniq, inv = torch.unique(group, return_inverse=True)  # (G,), (N,)
        gb, gi = uniq // (bs // tg), uniq % (bs // tg)
        x = _key_decode(codes[gb, :, gi], ranges[gb, :, gi])  # (G, H, tg, D)
        x[inv, :, off % tg] = k.float()
        filled = torch.full_like(uniq, -1).scatter_reduce(0, inv, off % tg, "amax")  # (G,) newest offset in each
        valid = torch.arange(tg, device=k.device)[None] <= filled[:, None]  # (G, tg)
        c, r = _key_encode(x, valid[:, None, :, None])
        codes[gb, :, gi] = c
        ranges[gb, :, gi] = r
        return {"k": c.flatten(-2), "kr": r.flatten(-2), "groups": uniq}  # (G, H, tg*D/2), (G, H, 2D), (G,)

    def encode(self, k: torch.Tensor, v: torch.Tensor, layers: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize ``k``, ``v`` (n, H, T, D) of the given layers (n,) into the regions' contents, each (n, H, T, width)."""
        if self.name == "int8":
            scale = self._key_scale(layers, k.device)[:, :, None] / _INT8_MAX  # (n, H, 1, D)
            kq = torch.round(k.float() / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).view(torch.uint8)
            vs = v.float().abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / _INT8_MAX  # (n, H, T, 1)
            vs = vs.to(torch.float16).float()  # round the scale first, so the codes use the one stored
            vq = torch.round(v.float() / vs).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).view(torch.uint8)
            return {"k": kq, "v": vq, "vs": vs.to(torch.float16)}
        n, H, T, D = k.shape
        tg = _key_tokens(self.block_size)
        if T % tg:
            raise ValueError(f"nf4 encodes keys in groups of {tg} tokens: {T} tokens are not whole groups")
        kc, kr = _key_encode(k.float().unflatten(2, (T // tg, tg)))  # (n, H, T/tg, tg, D/2), (n, H, T/tg, 2, D)
        vc, vs = _nf4_encode(_rotate(v.float()), _nf4_group(D))
        return {"k": kc.flatten(2, 3), "kr": kr.flatten(3), "v": vc, "vs": vs}

    def encode_rows(self, k: torch.Tensor, v: torch.Tensor, layers: torch.Tensor, row_len: int) -> torch.Tensor:
        """Whole rows ``(n, H, row_len)`` in the arena dtype from ``k``, ``v`` (n, H, bs, D) of ``layers`` (n,)."""
        n, H = k.shape[:2]
        out = torch.zeros(n, H, row_len, dtype=self.arena_dtype, device=k.device)
        if self.native:
            out[..., : 2 * self.block_size * self.head_dim] = torch.stack([k, v], dim=2).flatten(2).to(out.dtype)
            return out
        for name, val in self.encode(k, v, layers).items():
            self._region(out, name, val.dtype, val.shape[-2], val.shape[-1]).copy_(val)
        return out

    def read(self, rows: torch.Tensor, layers: int | torch.Tensor, heads: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows ``(n, H, R)`` of ``layers`` (one int, or (n,)) to K and V, each ``(n, H, bs, D)`` in the
        compute dtype. With ``heads`` (n,), each row is one head's: ``rows`` is ``(n, 1, R)``."""
        bs, D = self.block_size, self.head_dim
        if self.native:
            kv = rows[..., : 2 * bs * D].unflatten(-1, (2, bs, D))  # (n, H, 2, bs, D)
            return kv[:, :, 0].to(self.compute_dtype), kv[:, :, 1].to(self.compute_dtype)
        if self.name == "nf4":
            tg = _key_tokens(bs)
            k = _key_decode(self._region(rows, "k", torch.uint8, bs // tg, tg, D // 2),
                            self._region(rows, "kr", torch.float16, bs // tg, 2, D)).flatten(2, 3)
            v = _rotate(_nf4_decode(self._region(rows, "v", torch.uint8, bs, D // 2),
                                    self._region(rows, "vs", torch.float16, bs, D // _nf4_group(D)), _nf4_group(D)))
            return k.to(self.compute_dtype), v.to(self.compute_dtype)
        if heads is not None:
            scale = self._key_scale(layers, rows.device)[heads][:, None, None]  # (n, 1, 1, D)
        elif isinstance(layers, int):
            scale = self._key_scale(layers, rows.device)[None, :, None]  # (1, H, 1, D)
        else:
            scale = self._key_scale(layers, rows.device)[:, :, None]  # (n, H, 1, D)
        kq = self._region(rows, "k", torch.uint8, bs, D).view(torch.int8)
        vq = self._region(rows, "v", torch.uint8, bs, D).view(torch.int8)
        vs = self._region(rows, "vs", torch.float16, bs, 1)
        k = kq.float() * (scale / _INT8_MAX)
        v = vq.float() * vs.float()
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` (n, H, bs, D) after encoding and decoding: what a block holds once stored in this codec."""
        layers = torch.full((k.shape[0],), layer, dtype=torch.long)
        row_len = self.payload_bytes // self.arena_dtype.itemsize
        return self.read(self.encode_rows(k, v, layers, row_len), layers)


_LEVELS_CACHE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _levels(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 levels and the midpoints between neighbours (for rounding to the nearest level)."""
    got = _LEVELS_CACHE.get(device)
    if got is None:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
        got = (levels, (levels[1:] + levels[:-1]) / 2)
        _LEVELS_CACHE[device] = got
    return got


_PAIRS_CACHE: dict[tuple[str, torch.device], torch.Tensor] = {}


def _byte_pairs(values: str, device: torch.device) -> torch.Tensor:
    """(256, 2) float32: what each packed byte decodes to, low nibble then high, as NF4 ``"levels"`` or as
    ``"codes"`` 0-15. One gather through it unpacks a byte into both channels at once (4x faster than
    splitting the nibbles and gathering each)."""
    got = _PAIRS_CACHE.get((values, device))
    if got is None:
        table = _levels(device)[0] if values == "levels" else torch.arange(16, dtype=torch.float32, device=device)
        byte = torch.arange(256, device=device)
        got = _PAIRS_CACHE[(values, device)] = torch.stack([table[byte & 15], table[byte >> 4]], dim=-1)
    return got


def _unpack(packed: torch.Tensor, values: str) -> torch.Tensor:
    """Packed bytes (..., D/2) uint8 -> (..., D) float32 through ``_byte_pairs``."""
    pairs = _byte_pairs(values, packed.device)
    return F.embedding(packed.long(), pairs).flatten(-2)


def _nf4_encode(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., D) float32 -> packed codes (..., D/2) uint8 and per-group absmax (..., D/group) float16."""
    levels, mids = _levels(x.device)
    xg = x.unflatten(-1, (-1, group))  # (..., G, group)
    absmax = xg.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY).to(torch.float16)  # rounded before use
    codes = torch.bucketize((xg / absmax.float()).clamp_(-1, 1), mids).to(torch.uint8).flatten(-2)  # (..., D)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # two codes per byte: even channel low, odd channel high
    return packed, absmax.squeeze(-1)


_HADAMARD_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """(n, n) orthonormal Hadamard matrix, block-diagonal in the largest power of two dividing ``n``;
    symmetric, so it is its own inverse."""
    got = _HADAMARD_CACHE.get((n, device))
    if got is None:
        size = n & -n
        h = torch.ones(1, 1)
        while h.shape[0] < size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # Sylvester's construction
        got = torch.block_diag(*[h / math.sqrt(size)] * (n // size)).to(device)
        _HADAMARD_CACHE[(n, device)] = got
    return got


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., D) float32 through the Hadamard matrix: its own inverse, so the same call undoes it."""
    return x @ _hadamard(x.shape[-1], x.device)


def _key_encode(x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Key groups ``x`` (..., tg, D) float32 -> packed codes (..., tg, D/2) uint8 and per-channel minimum and
    maximum (..., 2, D) float16 over the tokens ``valid`` (broadcast to ``x``; None: all)."""
    lo_in = x if valid is None else x.masked_fill(~valid, float("inf"))
    hi_in = x if valid is None else x.masked_fill(~valid, float("-inf"))
    lo = lo_in.amin(dim=-2, keepdim=True).to(torch.float16)  # (..., 1, D): the stored ends are the ones used
    hi = torch.maximum(hi_in.amax(dim=-2, keepdim=True).to(torch.float16), lo)
    step = (hi.float() - lo.float()) / _KEY_LEVELS
    codes = torch.round((x - lo.float()) / step.clamp_min(_TINY)).clamp_(0, _KEY_LEVELS).to(torch.uint8)
    if valid is not None:
        codes = codes.masked_fill(~valid, 0)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even channel low, odd channel high
    return packed, torch.cat([lo, hi], dim=-2)


def _key_decode(packed: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Packed key codes (..., tg, D/2) and ranges (..., 2, D) -> float32 (..., tg, D)."""
    codes = _unpack(packed, "codes")  # (..., tg, D)
    lo, hi = ranges.float().split(1, dim=-2)  # (..., 1, D) each
    return lo + codes * ((hi - lo) / _KEY_LEVELS)


def _nf4_decode(packed: torch.Tensor, absmax: torch.Tensor, group: int) -> torch.Tensor:
    """Packed codes (..., D/2) and absmax (..., D/group) -> float32 (..., D)."""
    x = _unpack(packed, "levels").unflatten(-1, (-1, group))  # (..., G, group)
    return (x * absmax.float()[..., None]).flatten(-2)


def make_codec(name: str, block_size: int, head_dim: int, compute_dtype: Any = torch.float32,
               calibration: Calibration | None = None) -> Codec:
    if isinstance(compute_dtype, str):
        compute_dtype = getattr(torch, compute_dtype.removeprefix("torch."))
    return Codec(name, block_size, head_dim, compute_dtype, calibration)


# ---- calibration over real text ----
def calibration_windows(token_ids: Sequence[int], *, num_samples: int = 512, length: int = 64) -> list[list[int]]:
    """``num_samples`` windows of ``length`` tokens spread evenly over ``token_ids`` (deterministic: no randomness)."""
    if not 1 <= length <= len(token_ids):
        raise ValueError(f"calibration windows of {length} tokens need at least that many tokens, got {len(token_ids)}")
    span = len(token_ids) - length
    starts = [round(i * span / max(num_samples - 1, 1)) for i in range(num_samples)]
    return [list(token_ids[s : s + length]) for s in starts]


@torch.inference_mode()
def calibrate(model: Any, windows: Sequence[Sequence[int]], *, source: str, batch_size: int = 32) -> Calibration:
    """Run ``model`` over the token windows and take per-channel key scales from its post-RoPE keys.

    The windows go through in a fixed order and batch size, in float32, so the same text
    and model give the same scales.
    """
    device = next(model.parameters()).device
    key_bound: torch.Tensor | None = None
    value_max: torch.Tensor | None = None
    for i in range(0, len(windows), batch_size):
        ids = torch.tensor([list(w) for w in windows[i : i + batch_size]], dtype=torch.long, device=device)
        pkv = model(input_ids=ids, use_cache=True).past_key_values
        ks = torch.stack([layer.keys for layer in pkv.layers]).float()  # (L, B, H, T, D)
        vs = torch.stack([layer.values for layer in pkv.layers]).float()
        kb = _pair_bound(ks.transpose(1, 2).flatten(2, 3)).cpu()  # (L, H, D)
        vm = vs.abs().amax(dim=(1, 3)).cpu()  # (L, H, D)
        key_bound = kb if key_bound is None else torch.maximum(key_bound, kb)
        value_max = vm if value_max is None else torch.maximum(value_max, vm)
    if key_bound is None:
        raise ValueError("calibration needs at least one window of tokens")
    name = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    return Calibration(key_bound.clamp_min(_TINY), len(windows), sum(len(w) for w in windows), source, str(name),
                       value_max)


def calibration_text() -> str:
    """Real English text that ships with Python (``pydoc_data.topics``), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def calibration_tokens(tokenizer: Any) -> list[int]:
    """The first half of ``calibration_text``'s tokens: calibration never sees the second half, which
    the quality benchmark evaluates on."""
    ids = tokenizer(calibration_text())["input_ids"]
    return list(ids[: len(ids) // 2])


def default_calibration(model: Any, tokenizer: Any, *, name: str, num_samples: int = 512, length: int = 32,
                        cache_dir: str | None = None) -> Calibration:
    """The calibration of ``model`` over ``num_samples`` windows of Python's documentation, computed once
    and kept as safetensors in kvdoctor's cache directory (the same text and model load the same file)."""
    import os


    ids = calibration_tokens(tokenizer)
    key = hashlib.sha256(repr((name, num_samples, length, ids)).encode()).hexdigest()[:16]
    directory = cache_dir or str(cache_home() / "calibration")
    path = os.path.join(directory, f"{name}-{key}.safetensors")
    if os.path.exists(path):
        return Calibration.load(path)
    cal = calibrate(model, calibration_windows(ids, num_samples=num_samples, length=length),
                    source=f"pydoc_data.topics[:half] {num_samples}x{length} tokens ({key})")
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    cal.save(tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    return cal
