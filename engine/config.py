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
        import torch

        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def row_elems(self) -> int:
        """Elements of one (layer, head) row of a block: its K then its V, padded to 128 bytes."""
        payload = 2 * self.block_size * self.head_dim * self.dtype_bytes
        return -(-payload // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES // self.dtype_bytes

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in any arena, padding included."""
        return self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def payload_bytes_per_token(self) -> int:
        """K and V bytes of one token across all layers, without padding."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tiers that exist (capacity > 0), fastest first."""
        return tuple(t for t in TIER_NAMES if self.capacity(t) > 0)

    def capacity(self, tier: str) -> int:
        return int(getattr(self, f"{tier}_blocks"))

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")
