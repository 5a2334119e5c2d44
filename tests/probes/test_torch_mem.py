"""The engine's own accounting folded into totals, and torch.cuda read without side effects."""

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
    def __init__(self, stats):
        self._stats = stats

    def stats(self):
        return self._stats


@pytest.mark.parametrize("stats", [
    {"tiers": {"device": {"bytes": 10, "used_blocks": 1}, "host": {"bytes": 20}}, "cpu_tensor_bytes": 99},
    {"device": {"bytes": 10}, "host": {"bytes": 20}, "cpu_tensors": 99},
    {"device_bytes": 10, "host_bytes": 20, "cpu_tensor_bytes": 99, "fragmentation": 0.5},
])
def test_cache_accounting_reads_the_shapes_of_stats(stats):
    assert cache_accounting(_Cache(stats))() == {"device": 10, "host": 20, "cpu_tensors": 99}


def test_cuda_allocator_reads_nothing_without_cuda():
    torch = pytest.importorskip("torch")
    allocator = CudaAllocator()
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by benchmarks/gpu_check.py")
    assert not allocator.available and allocator.read() is None
