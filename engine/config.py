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
from typing import Any

from .faults import FAULTS

__all__ = ["EngineConfig", "TIER_NAMES", "DTYPES", "ROW_ALIGN_BYTES"]

TIER_NAMES: tuple[str, ...] = ("device", "host", "disk")  # fastest to slowest
DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per element
ROW_ALIGN_BYTES = 128  # one (layer, head) K+V row of a block starts on a 128-byte boundary
POLICIES = ("lru", "hybrid")
IMPORTANCE_MODES = ("h2o", "streaming")  # importance eviction: heavy hitters (H2O), sliding window with sinks (StreamingLLM)


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
    checksums: bool = True
    fault: str | None = None
    codec: str | None = None  # how blocks are stored (codecs.CODECS); None: ``dtype`` as it is
    calibration: Any = None  # codecs.Calibration: the per-channel key scales int8 and nf4 need
    topk: int = 0  # block-sparse attention reads this many blocks chosen by key summary (+ sinks, window); 0: dense
    sink_blocks: int = 1  # first blocks always read (sparse) and never evicted (importance)
    local_blocks: int = 1  # newest blocks always read (sparse) and never evicted (importance)
    importance: str | None = None  # importance eviction: "h2o" or "streaming" (None: off)
    kv_budget_blocks: int = 0  # importance eviction keeps each sequence within this many blocks
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes carried into the trace header

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
                setattr(self, f"{tier}_blocks", nbytes // self.bytes_per_block)
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
        if self.fault is not None and self.fault not in FAULTS:
            raise _bad("fault", self.fault, f"None or one of {', '.join(FAULTS)}")

    def _check_compression(self) -> None:
        from .codecs import CODECS, NATIVE, codec_of_dtype

        if self.codec is None:
            self.codec = codec_of_dtype(self.dtype)
        if self.codec not in CODECS:
            raise _bad("codec", self.codec, f"None or one of {', '.join(CODECS)}")
        if self.codec == "nf4" and self.head_dim % 2:
            raise _bad("codec", self.codec, f"not nf4 for an odd head_dim ({self.head_dim}): nf4 packs two codes per byte")
        if self.codec not in NATIVE:
            want = (self.num_layers, self.num_kv_heads, self.head_dim)
            got = tuple(getattr(getattr(self.calibration, "key_scale", None), "shape", ()))
            if got != want:
                raise _bad("calibration", self.calibration,
                           f"a codecs.Calibration with key scales of shape {want} for codec {self.codec!r}")
        _int_in("topk", self.topk, 0, 1 << 20)
        _int_in("sink_blocks", self.sink_blocks, 0, 1 << 10)
        _int_in("local_blocks", self.local_blocks, 1, 1 << 10)
        if self.importance is not None and self.importance not in IMPORTANCE_MODES:
            raise _bad("importance", self.importance, f"None or one of {', '.join(IMPORTANCE_MODES)}")
        if self.importance is not None:
            lo = self.sink_blocks + self.local_blocks + (1 if self.importance == "h2o" else 0)
            _int_in("kv_budget_blocks", self.kv_budget_blocks, lo, 1 << 24)

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

    # ---- derived sizes ----
    @property
    def torch_dtype(self) -> Any:
        """Element type of the arenas: ``dtype`` or the codec's (bytes for a quantized codec)."""
        import torch

        from .codecs import NATIVE

        return getattr(torch, NATIVE.get(self.codec, "uint8"))

    @property
    def compute_dtype(self) -> Any:
        """What ``store`` takes and attention reads: K/V decoded from any codec come back as this."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one arena element."""
        return self.torch_dtype.itemsize

    @property
    def row_payload_bytes(self) -> int:
        """Bytes of one (layer, head) row of a block under the codec, before padding."""
        from .codecs import row_payload_bytes

        return row_payload_bytes(self.codec, self.block_size, self.head_dim)

    @property
    def row_elems(self) -> int:
        """Elements of one (layer, head) row of a block: its K then its V (codes and scales), padded to 128 bytes."""
        return -(-self.row_payload_bytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES // self.dtype_bytes

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in any arena, padding included."""
        return self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def payload_bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers under the codec (scales included), without padding."""
        return self.num_layers * self.num_kv_heads * self.row_payload_bytes // self.block_size

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tiers that exist (capacity > 0), fastest first."""
        return tuple(t for t in TIER_NAMES if self.capacity(t) > 0)

    def capacity(self, tier: str) -> int:
        return int(getattr(self, f"{tier}_blocks"))

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")
