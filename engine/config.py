"""``EngineConfig``: the one object that says what the KV cache looks like, validated once.

Every size the engine needs (bytes per block, padded row length, tier capacities
in blocks) is derived here, so no other module recomputes it and a bad value
fails at construction with the field's name and accepted range rather than deep
inside a swap.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..knobs import VERIFY_MODES  # content digests: see engine.kv.digest
from .faults import FAULTS

DISK_IO_MODES = ("auto", "direct", "buffered")  # disk arena I/O: see engine.kv.storage.DiskArena

__all__ = ["EngineConfig", "Layout", "Tier", "TIER_NAMES", "DTYPES", "ROW_ALIGN_BYTES", "MIXED", "VERIFY_MODES",
           "DISK_IO_MODES"]


class Tier(StrEnum):
    """The three tiers, fastest first. A ``str`` too, so a plain ``"host"`` from a caller is the same tier
    and events carry the plain string on the wire."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


TIER_NAMES: tuple[str, ...] = tuple(Tier)  # fastest to slowest
DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per element
ROW_ALIGN_BYTES = 128  # one (layer, head) K+V row of a block starts on a 128-byte boundary
POLICIES = ("lru", "hybrid")
IMPORTANCE_MODES = ("h2o", "streaming")  # importance eviction: heavy hitters (H2O), sliding window with sinks (StreamingLLM)
MIXED = "mixed"  # device codec: new blocks at high precision, demoted to ``mixed_low`` once unimportant


@dataclass(frozen=True)
class Layout:
    """Sizes of one block stored under one codec; every arena of that codec uses them."""

    codec: str
    torch_dtype: Any  # element type of the arena: the codec's dtype, or uint8 for a quantized codec
    row_payload_bytes: int  # one (layer, head) row, K then V (codes and scales), before padding
    row_elems: int  # the row padded to 128 bytes, in elements of ``torch_dtype``
    row_bytes: int
    bytes_per_block: int  # all layers and heads, padding included
    payload_bytes_per_token: int  # K and V of one token across all layers, scales included, no padding


def _bad(name: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"EngineConfig.{name}={value!r}: must be {accepted}")


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, value, f"an integer in [{lo}, {hi}]")


def _weight(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _bad(name, value, "a finite number >= 0")


@dataclass
class EngineConfig:
    """Shape, tiers and policies of one paged KV cache.

    Capacities are in blocks; give ``*_bytes`` instead to size a tier by memory (it
    is rounded down to whole blocks). A tier with capacity 0 does not exist; the
    device tier always does. ``device="auto"`` picks CUDA when it is present.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: Any = "float16"
    device: str = "cpu"
    device_blocks: int = 256
    host_blocks: int = 1024
    disk_blocks: int = 0
    device_bytes: int | None = None
    host_bytes: int | None = None
    disk_bytes: int | None = None
    chunk_blocks: int = 64  # arenas grow by this many blocks at a time, up to their capacity
    eviction: str = "lru"
    recency_weight: float = 1.0
    distance_weight: float = 0.5
    importance_weight: float = 1.0
    prefetch_depth: int = 4  # blocks brought up ahead per prefetch request; 0 switches prefetch off
    disk_dir: str | None = None  # parent of the private spill directory; None -> the system temp dir
    # Disk arena I/O: "direct" (O_DIRECT, bypassing the page cache), "buffered", or "auto": direct where the
    # spill directory's filesystem takes it, else buffered (engine.kv.storage.DiskArena; the trace header says which)
    disk_io: str = "auto"
    checksums: bool = True
    fault: str | None = None
    # Content digests (engine.kv.digest): verify "full" (every read), "sample" (a bounded sweep: every block a
    # sequence reads is verified at least once in every ``verify_every`` of its reads, whatever its length, and
    # a sequence's first read and a block's first after a fresh write at once) or "off"; None: $KVDOCTOR_VERIFY,
    # else "sample". Swaps are always verified.
    verify: str | None = None
    verify_every: int = 32
    # How blocks are stored: one of codecs.CODECS (every tier), "mixed" (device; slower tiers at its high codec),
    # or per tier: {"device": "fp16", "host": "int8", "disk": "nf4"} or "device=fp16,host=int8,disk=nf4"
    # (a tier left out takes the next faster tier's). None: ``dtype`` as it is. Precision only goes down as
    # blocks go down: a tier's codec may not be less lossy than a faster tier's.
    codec: Any = None
    calibration: Any = None  # codecs.Calibration: the per-channel key scales int8 needs
    topk: int = 0  # block-sparse attention reads this many blocks chosen by key summary (+ sinks, window); 0: dense
    sink_blocks: int = 1  # first blocks always read (sparse) and never evicted (importance)
    local_blocks: int = 1  # newest blocks always read (sparse) and never evicted (importance)
    sparse_block_size: int = 0  # tokens per page top-k selects (a multiple of block_size); 0: block_size
    # top-k for decode only: a chunk of several queries (prefill) attends to every block, as Quest does, so the keys
    # and values it stores are the dense model's; False: each query of a chunk reads its own top-k pages too
    dense_prefill: bool = False
    # the first this many layers attend densely under top-k (Quest leaves its first two layers dense: their attention
    # is spread too evenly for a few pages to hold it)
    dense_layers: int = 0
    # Long context (engine.kv.readplan, engine.kv.staging): a running sequence's blocks may live in any tier, and attention
    # reads slower tiers' blocks through a device staging area of this many blocks; 0: every block read is resident
    staging_blocks: int = 0
    # Token merging (engine.kv.merge): in old, full blocks, adjacent tokens whose keys have at least this cosine
    # similarity (per layer and KV head) share one slot with a count; 0: off
    merge: float = 0.0
    importance: str | None = None  # importance eviction: "h2o" or "streaming" (None: off)
    kv_budget_blocks: int = 0  # importance eviction keeps each sequence within this many blocks
    mixed_low: str = "nf4"  # mixed: the codec a block is demoted to
    mixed_window: int = 4  # mixed: a sequence's newest blocks stay high (the recent window)
    mixed_high_blocks: int = 0  # mixed: at least this many of a sequence's older blocks stay high, by attention mass
    mixed_high_fraction: float = 0.25  # mixed: ... or this fraction of its blocks, whichever is more
    # Automatic prefix caching (engine.kv.prefix): full blocks found again by a chain of content keys. ``prefix_salt``
    # names what decides a token's K/V besides the tokens (model, weights digest, rope scaling; the runner fills
    # it from the model); the cache adds its KV codec, and each request its adapter.
    prefix_cache: bool = False
    prefix_salt: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes carried into the trace header
    mixed: bool = field(init=False, default=False)  # derived: the device codec is "mixed"
    _tier_codecs: dict[str, str] = field(init=False, repr=False, compare=False, default_factory=dict)
    _block_codecs: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())
    _layouts: dict[str, Layout] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        _int_in("num_layers", self.num_layers, 1, 1024)
        _int_in("num_kv_heads", self.num_kv_heads, 1, 1024)
        _int_in("head_dim", self.head_dim, 1, 4096)
        _int_in("block_size", self.block_size, 1, 256)
        if self.block_size & (self.block_size - 1):
            raise _bad("block_size", self.block_size, "a power of two in [1, 256] (16 by default; 64 and 128 for block-sparse retrieval)")
        self.dtype = self._dtype_name(self.dtype)
        self.device = self._device_name(self.device)
        self._check_compression()  # before any size is derived: the codec fixes the row layout
        for tier in TIER_NAMES:
            nbytes = getattr(self, f"{tier}_bytes")
            if nbytes is not None:
                _int_in(f"{tier}_bytes", nbytes, 0, 1 << 50)
                setattr(self, f"{tier}_blocks", nbytes // self.layout(self.tier_codec(tier)).bytes_per_block)
        _int_in("device_blocks", self.device_blocks, 1, 1 << 24)
        _int_in("host_blocks", self.host_blocks, 0, 1 << 26)
        _int_in("disk_blocks", self.disk_blocks, 0, 1 << 28)
        _int_in("chunk_blocks", self.chunk_blocks, 1, 1 << 20)
        if self.eviction not in POLICIES:
            raise _bad("eviction", self.eviction, f"one of {', '.join(POLICIES)}")
        for name in ("recency_weight", "distance_weight", "importance_weight"):
            _weight(name, getattr(self, name))
        if self.eviction == "hybrid" and not (self.recency_weight or self.distance_weight or self.importance_weight):
            raise _bad("recency_weight", self.recency_weight, "> 0 for at least one hybrid weight")
        _int_in("prefetch_depth", self.prefetch_depth, 0, 1 << 16)
        if self.disk_dir is not None and not isinstance(self.disk_dir, (str, os.PathLike)):
            raise _bad("disk_dir", self.disk_dir, "a directory path or None")
        if self.disk_io not in DISK_IO_MODES:
            raise _bad("disk_io", self.disk_io, f"one of {', '.join(DISK_IO_MODES)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise _bad("fault", self.fault, f"None or one of {', '.join(FAULTS)}")
        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise _bad("verify", self.verify, f"None or one of {', '.join(VERIFY_MODES)}")
        _int_in("verify_every", self.verify_every, 1, 1 << 20)
        _int_in("staging_blocks", self.staging_blocks, 0, 1 << 20)
        self._check_merge()
        if self.staging_blocks and self.device_blocks < self.pinned_blocks + 1:
            raise _bad("device_blocks", self.device_blocks,
                       f">= {self.pinned_blocks + 1} with staging_blocks (the sinks, the recent window and a block to write)")

    def _check_merge(self) -> None:
        m = self.merge
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (m == 0 or 0 < m <= 1):
            raise _bad("merge", m, "0 (off) or a cosine similarity threshold in (0, 1]")
        if m and self.staging_blocks:  # streamed reads do not carry merged slots' counts yet
            raise _bad("merge", m, "0 with staging_blocks (streamed reads do not weigh merged slots yet)")

    def _check_compression(self) -> None:
        from .kv.codecs import CODECS, NEEDS_CALIBRATION, PRECISION, codec_of_dtype

        raw = self.codec
        self.codec = self._codec_setting(raw)
        if isinstance(self.codec, dict):
            per_tier: dict[str, str | None] = dict(self.codec)
        else:  # "mixed" is the device's; the slower tiers hold its high codec
            per_tier = {t: self.codec if self.codec != MIXED or t == Tier.DEVICE else None for t in TIER_NAMES}
        if MIXED in [per_tier[t] for t in TIER_NAMES[1:]]:
            raise _bad("codec", raw, f"{MIXED!r} for the device tier only (slower tiers hold one codec each)")
        native = codec_of_dtype(self.dtype)
        high = native if native != "fp32" else "fp16"  # fp32 KV is no one's high precision: fp16 is
        self.mixed = per_tier[Tier.DEVICE] == MIXED
        tier_codecs = {}
        for t in TIER_NAMES:
            c = per_tier[t] if per_tier[t] not in (MIXED, None) else high
            if c not in CODECS:
                raise _bad("codec", raw, f"None, {MIXED!r}, one of {', '.join(CODECS)}, or per tier "
                           f"(device=fp16,host=int8,disk=nf4) with those; {t}={c!r} is not")
            tier_codecs[t] = c
        codecs = set(tier_codecs.values())
        if self.mixed:
            if self.mixed_low not in CODECS or PRECISION[self.mixed_low] <= PRECISION[high]:
                raise _bad("mixed_low", self.mixed_low,
                           f"a codec lossier than the high one ({high}): one of "
                           f"{', '.join(c for c in CODECS if PRECISION[c] > PRECISION[high])}")
            codecs.add(self.mixed_low)
            _int_in("mixed_window", self.mixed_window, 1, 1 << 20)
            _int_in("mixed_high_blocks", self.mixed_high_blocks, 0, 1 << 20)
            if (isinstance(self.mixed_high_fraction, bool) or not isinstance(self.mixed_high_fraction, (int, float))
                    or not 0 <= self.mixed_high_fraction <= 1):
                raise _bad("mixed_high_fraction", self.mixed_high_fraction, "a number in [0, 1]")
        faster = None
        for t in TIER_NAMES:  # precision only goes down as blocks go down
            if faster is not None and PRECISION[tier_codecs[t]] < PRECISION[tier_codecs[faster]]:
                raise _bad("codec", raw, f"no less lossy on {t} ({tier_codecs[t]}) than on the faster "
                           f"{faster} ({tier_codecs[faster]}): precision only goes down as blocks go down")
            faster = t
        self._tier_codecs = tier_codecs
        if isinstance(self.codec, dict):  # every tier named, as it resolved
            self.codec = {t: MIXED if t == Tier.DEVICE and self.mixed else tier_codecs[t] for t in TIER_NAMES}
        # every codec a block can hold; a tier keeps an arena for each one at least as lossy as its own
        self._block_codecs = tuple(sorted(codecs, key=PRECISION.__getitem__))
        self._layouts = {}
        if "nf4" in codecs and self.head_dim % 2:
            raise _bad("codec", raw, f"without nf4 for an odd head_dim ({self.head_dim}): nf4 packs two codes per byte")
        calibrated = sorted(c for c in codecs if c in NEEDS_CALIBRATION)
        if calibrated or self.calibration is not None:  # one given for no codec must still fit the model
            want = (self.num_layers, self.num_kv_heads, self.head_dim)
            got = tuple(getattr(getattr(self.calibration, "key_scale", None), "shape", ()))
            if got != want:
                raise _bad("calibration", self.calibration, f"a codecs.Calibration with key scales of shape {want}"
                           + (f" for codec {'/'.join(calibrated)!r}" if calibrated else ""))
        _int_in("topk", self.topk, 0, 1 << 20)
        _int_in("sink_blocks", self.sink_blocks, 0, 1 << 10)
        _int_in("local_blocks", self.local_blocks, 1, 1 << 10)
        _int_in("sparse_block_size", self.sparse_block_size, 0, 1 << 16)
        _int_in("dense_layers", self.dense_layers, 0, 1 << 10)
        self.sparse_block_size = self.sparse_block_size or self.block_size
        if self.sparse_block_size % self.block_size:
            raise _bad("sparse_block_size", self.sparse_block_size, f"a multiple of block_size ({self.block_size})")
        if self.importance is not None and self.importance not in IMPORTANCE_MODES:
            raise _bad("importance", self.importance, f"None or one of {', '.join(IMPORTANCE_MODES)}")
        if self.importance is not None:
            lo = self.sink_blocks + self.local_blocks + (1 if self.importance == "h2o" else 0)
            _int_in("kv_budget_blocks", self.kv_budget_blocks, lo, 1 << 24)

    def _codec_setting(self, value: Any) -> str | dict[str, str]:
        """``codec`` normalized: one name for every tier, or a dict naming every tier's codec."""
        from .kv.codecs import codec_of_dtype

        if value is None:
            return codec_of_dtype(self.dtype)
        if isinstance(value, str) and "=" in value:
            pairs = [p.partition("=") for p in value.split(",") if p.strip()]
            value = {k.strip(): v.strip() for k, _, v in pairs}
            if any(not k or not v for k, v in value.items()) or len(value) != len(pairs):
                raise _bad("codec", self.codec, "per tier as TIER=CODEC[,TIER=CODEC...], each tier once")
        if isinstance(value, str):
            return value
        if not isinstance(value, dict) or not value or not set(value) <= set(TIER_NAMES):
            raise _bad("codec", value, f"a codec name or a dict from tiers ({', '.join(TIER_NAMES)}) to codec names")
        full: dict[str, Any] = {}
        prev: Any = codec_of_dtype(self.dtype)
        for t in TIER_NAMES:  # a tier left out takes the next faster tier's codec (a mixed device's: its high one)
            prev = full[t] = value.get(t, None if prev == MIXED else prev)
        if full[Tier.DEVICE] != MIXED and len(set(full.values())) == 1:
            return full[Tier.DEVICE]
        return full

    @staticmethod
    def _dtype_name(value: Any) -> str:
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            raise _bad("dtype", value, f"one of {', '.join(DTYPES)}")
        return name

    @staticmethod
    def _device_name(value: Any) -> str:
        name = str(value)
        if name == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cpu":
            return name
        kind, _, index = name.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise _bad("device", value, '"cpu", "cuda", "cuda:N" or "auto"')
        import torch

        if not torch.cuda.is_available():
            raise _bad("device", value, '"cpu" or "auto" on this machine (CUDA is not available)')
        return name

    # ---- codecs and derived sizes ----
    def tier_codec(self, tier: str) -> str:
        """The codec ``tier`` stores blocks in (on a mixed device: the high one new blocks get)."""
        return self._tier_codecs[tier]

    @property
    def tier_codecs(self) -> dict[str, str]:
        """Each existing tier's codec, fastest first."""
        return {t: self._tier_codecs[t] for t in self.tiers}

    @property
    def block_codecs(self) -> tuple[str, ...]:
        """Every codec a block can be held in, least lossy first."""
        return self._block_codecs

    def arena_codecs(self, tier: str) -> tuple[str, ...]:
        """The codecs ``tier`` keeps arenas for: its own first, then the lossier ones a block can arrive in."""
        from .kv.codecs import PRECISION

        own = self._tier_codecs[tier]
        return (own, *(c for c in self._block_codecs if PRECISION[c] > PRECISION[own]))

    def layout(self, codec: str | None = None) -> Layout:
        """Sizes of a block under ``codec`` (default: the device tier's)."""
        codec = codec or self._tier_codecs[Tier.DEVICE]
        got = self._layouts.get(codec)
        if got is None:
            import torch

            from .kv.codecs import NATIVE, row_payload_bytes

            dtype = getattr(torch, NATIVE.get(codec, "uint8"))
            payload = row_payload_bytes(codec, self.block_size, self.head_dim)
            elems = -(-payload // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES // dtype.itemsize
            got = self._layouts[codec] = Layout(
                codec, dtype, payload, elems, elems * dtype.itemsize,
                self.num_layers * self.num_kv_heads * elems * dtype.itemsize,
                self.num_layers * self.num_kv_heads * payload // self.block_size)
        return got

    @property
    def torch_dtype(self) -> Any:
        """Element type of the device tier's arena: ``dtype`` or the codec's (bytes for a quantized codec)."""
        return self.layout().torch_dtype

    @property
    def compute_dtype(self) -> Any:
        """What ``store`` takes and attention reads: K/V decoded from any codec come back as this."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element of the device tier's arena."""
        return self.torch_dtype.itemsize

    @property
    def row_payload_bytes(self) -> int:
        """Bytes of one (layer, head) row of a block under the device tier's codec, before padding."""
        return self.layout().row_payload_bytes

    @property
    def row_elems(self) -> int:
        """Elements of one (layer, head) row of a device block: its K then its V (codes and scales), padded to 128 bytes."""
        return self.layout().row_elems

    @property
    def row_bytes(self) -> int:
        return self.layout().row_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in the device tier's arena, padding included (``layout(codec)`` for another codec)."""
        return self.layout().bytes_per_block

    @property
    def payload_bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers under the device tier's codec (scales included), without padding."""
        return self.layout().payload_bytes_per_token

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tiers that exist (capacity > 0), fastest first."""
        return tuple(t for t in TIER_NAMES if self.capacity(t) > 0)

    def capacity(self, tier: str) -> int:
        return int(getattr(self, f"{tier}_blocks"))

    @property
    def long_context(self) -> bool:
        """A sequence may be longer than the device tier: its slower tiers' blocks are read through staging."""
        return self.staging_blocks > 0

    @property
    def pinned_blocks(self) -> int:
        """Blocks of a long sequence that never leave the device: its sinks and its recent window."""
        return self.sink_blocks + self.local_blocks

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")
