"""The engine's own accounting folded into totals, and torch.cuda read without side effects."""

from types import SimpleNamespace

import pytest

from kvdoctor.probes.torch_mem import CudaAllocator, cache_accounting, engine_bytes


def test_without_cpu_tensor_figure_the_cpu_resident_tiers_count():
    # GIVEN KV bytes per tier
    accounting = {"device": 1000, "host": 300, "disk": 50}
    # WHEN the device tier is host memory (no CUDA) THEN it counts as CPU tensors with host; disk never does
    assert engine_bytes(accounting, device_on_cpu=True).cpu_tensors == 1300
    # WHEN the device tier is a GPU THEN only host counts
    on_gpu = engine_bytes(accounting, device_on_cpu=False)
    assert on_gpu.cpu_tensors == 300 and on_gpu.kv == 1350
    assert on_gpu.by_tier == {"device": 1000, "host": 300, "disk": 50}


def test_an_explicit_cpu_tensor_figure_wins():
    # Arenas hold unused capacity too: the engine knows its real tensor bytes
    assert engine_bytes({"host": 300, "cpu_tensors": 4096}, device_on_cpu=True).cpu_tensors == 4096


class _Cache:
    """What ``PagedKVCache`` exposes to the accounting: ``config.is_cuda`` and ``stats()``."""

    def __init__(self, is_cuda):
        self.config = SimpleNamespace(is_cuda=is_cuda)

    def stats(self):
        return {"tiers": {
            "device": {"used_blocks": 2, "used_bytes": 10, "arena_bytes": 640},
            "host": {"used_blocks": 4, "used_bytes": 20, "arena_bytes": 1280},
            "disk": {"used_blocks": 1, "used_bytes": 5, "arena_bytes": 4096},
        }, "fragmentation": 0.5}


def test_cache_accounting_counts_used_kv_and_whole_cpu_arenas():
    # GIVEN an engine on the CPU THEN its CPU tensors are the device and host arenas, free capacity included
    assert cache_accounting(_Cache(is_cuda=False))() == {"device": 10, "host": 20, "disk": 5, "cpu_tensors": 1920}
    # GIVEN an engine on a GPU THEN only the host arena is CPU memory
    assert cache_accounting(_Cache(is_cuda=True))()["cpu_tensors"] == 1280


def test_cuda_allocator_reads_nothing_without_cuda():
    torch = pytest.importorskip("torch")
    allocator = CudaAllocator()
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by benchmarks/gpu_check.py")
    assert not allocator.available and allocator.read() is None
