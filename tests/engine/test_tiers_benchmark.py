"""The tier benchmark runs, and its memory-waste figure meets the goal on a small workload."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "tiers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_tiers", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paged_waste_is_small_where_max_length_preallocation_wastes_most(bench, tmp_path):
    w = bench.memory_waste(num_live=8, max_len=2048, steps=150, seed=1, spill_dir=str(tmp_path))
    assert w["paged_waste"] < 0.04
    assert 0.6 < w["prealloc_waste"] < 0.95


def test_swap_bandwidth_reports_every_tier_pair(bench, tmp_path):
    rows = bench.swap_bandwidth(num_blocks=4, repeats=2, spill_dir=str(tmp_path))
    assert {(r["src"], r["dst"]) for r in rows} == {
        ("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"), ("device", "disk"), ("disk", "device")}
    assert all(r["swap_gbs"] > 0 and r["copy_gbs"] > 0 for r in rows)
