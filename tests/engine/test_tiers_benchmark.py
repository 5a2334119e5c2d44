"""The tier benchmark runs, and its memory-waste figure meets the goal on a small workload."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("tiers")


def test_paged_waste_is_small_where_max_length_preallocation_wastes_most(bench, tmp_path):
    w = bench.memory_waste(num_live=8, max_len=2048, steps=150, seed=1, spill_dir=str(tmp_path))
    assert w["paged_waste"] < 0.04
    assert 0.6 < w["prealloc_waste"] < 0.95


def test_swap_bandwidth_reports_every_tier_pair(bench, tmp_path):
    rows = bench.swap_bandwidth(num_blocks=4, repeats=2, spill_dir=str(tmp_path))
    assert {(r["src"], r["dst"]) for r in rows} == {
        ("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"), ("device", "disk"), ("disk", "device")}
    assert all(r["swap_gbs"] > 0 and r["copy_gbs"] > 0 for r in rows)


def test_checksum_kernels_are_measured_against_a_plain_memcpy(bench):
    rows = bench.checksum_kernels(num_blocks=4, repeats=2)
    assert rows[0]["kernel"].startswith("memcpy, no checksum") and rows[0]["ratio"] == 1.0
    assert any("without a C compiler" in r["kernel"] for r in rows) and all(r["gbs"] > 0 for r in rows)


def test_without_root_the_page_cache_is_advised_out_and_the_output_says_so(bench, tmp_path, monkeypatch):
    # GIVEN a disk arena with written blocks, and /proc/sys/vm/drop_caches not writable (not root)
    import builtins
    import os

    from kvdoctor.engine.config import EngineConfig
    from kvdoctor.engine.kv.storage import DiskArena

    a = DiskArena("disk", EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, disk_blocks=4,
                                       disk_dir=str(tmp_path), disk_io="buffered"))
    a.grow()
    real_open, advised = builtins.open, []

    def no_root(path, *args, **kw):
        if str(path) == "/proc/sys/vm/drop_caches":
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kw)

    monkeypatch.setattr(builtins, "open", no_root)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: advised.append(advice))
    try:
        # WHEN the benchmark drops the page cache before a buffered read
        note = bench.drop_page_cache(a)
    finally:
        a.close()
    # THEN it advised the spill file's pages out instead, and says what that means for the figure
    assert advised == [os.POSIX_FADV_DONTNEED]
    assert note.startswith("NOT dropped") and "needs root" in note and "overstate" in note
