"""EngineConfig: defaults, derived sizes, and a ValueError naming the field for every bad value."""

from __future__ import annotations

import pytest

from kvdoctor.engine.config import ROW_ALIGN_BYTES, EngineConfig


def test_defaults_and_derived_sizes():
    # GIVEN a SmolLM2-like shape with defaults
    c = EngineConfig(num_layers=30, num_kv_heads=3, head_dim=64)
    # THEN block size is 16, fp16, and one (layer, head) row holds K then V, 128-byte aligned
    assert c.block_size == 16 and c.dtype == "float16" and c.device == "cpu"
    assert c.row_bytes == 2 * 16 * 64 * 2 and c.row_bytes % ROW_ALIGN_BYTES == 0
    assert c.bytes_per_block == 30 * 3 * c.row_bytes
    assert c.payload_bytes_per_token == 30 * 2 * 3 * 64 * 2
    assert c.tiers == ("device", "host")  # disk off by default


def test_rows_are_padded_to_128_bytes():
    # GIVEN a row whose payload (2 * 1 * 3 * 4 = 24 bytes) is not a multiple of 128
    c = EngineConfig(num_layers=1, num_kv_heads=1, head_dim=3, block_size=1, dtype="float32")
    # THEN it is padded up to one 128-byte line
    assert c.row_bytes == 128 and c.row_elems == 32


@pytest.mark.parametrize("bs", [16, 64, 128])
def test_block_sizes_for_block_sparse_retrieval(bs):
    assert EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=bs).block_size == bs


def test_capacity_in_bytes_is_rounded_down_to_blocks():
    c = EngineConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", host_bytes=10_000, disk_bytes=0)
    assert c.host_blocks == 10_000 // c.bytes_per_block
    assert c.disk_blocks == 0 and "disk" not in c.tiers


def test_torch_dtype_objects_are_accepted():
    import torch

    assert EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16).dtype == "bfloat16"


BAD = [
    ("num_layers", 0, "[1, 1024]"),
    ("num_kv_heads", -1, "[1, 1024]"),
    ("head_dim", 1.5, "integer"),
    ("block_size", 24, "power of two"),
    ("block_size", 512, "[1, 256]"),
    ("dtype", "int8", "float32"),
    ("device", "tpu", '"cpu"'),
    ("device_blocks", 0, "[1,"),
    ("host_blocks", -3, "[0,"),
    ("disk_blocks", True, "integer"),
    ("chunk_blocks", 0, "[1,"),
    ("eviction", "fifo", "lru, hybrid"),
    ("recency_weight", -1.0, ">= 0"),
    ("importance_weight", float("nan"), "finite"),
    ("prefetch_depth", -1, "[0,"),
    ("disk_dir", 3, "directory"),
    ("fault", "segfault", "leak-swapped"),
    ("host_bytes", -1, "[0,"),
]


@pytest.mark.parametrize("field,value,accepted", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_values_name_the_field_and_range(field, value, accepted):
    # WHEN a config is built with one bad value
    with pytest.raises(ValueError) as exc:
        EngineConfig(**{"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, field: value})
    # THEN the message names the field and says what is accepted
    assert f"EngineConfig.{field}=" in str(exc.value) and accepted in str(exc.value)


def test_hybrid_needs_a_positive_weight():
    with pytest.raises(ValueError, match="at least one hybrid weight"):
        EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, eviction="hybrid",
                     recency_weight=0, distance_weight=0, importance_weight=0)


def test_cuda_without_cuda_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cuda")
    assert EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="auto").device == "cpu"
