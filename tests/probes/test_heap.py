"""Heap probe: tracemalloc growth attributed to the line of the code under diagnosis."""

import json
import tracemalloc

import pytest

from kvdoctor.probes.heap import HeapProbe, top_growth


@pytest.fixture
def heap():
    was_tracing = tracemalloc.is_tracing()
    probe = HeapProbe()
    yield probe
    probe.close()
    assert tracemalloc.is_tracing() == was_tracing  # closing restores what it found


def line_of(marker: str, path: str = __file__) -> int:
    """The number of the one line in ``path`` that ends with ``# <marker>``."""
    with open(path) as f:
        (line,) = [n for n, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}")]
    return line


def _grow(into: list, n: int) -> int:
    for i in range(n):
        into.append({"i": i, "pad": "x" * 40})  # growth-site
    return line_of("growth-site")


def _grow_through_stdlib(into: list, n: int) -> int:
    for i in range(n):
        into.append(json.loads('{"a": [1, 2, 3], "b": "%s"}' % ("y" * 40)))  # json-caller
    return line_of("json-caller")


def test_growing_structure_is_attributed_to_its_line(heap):
    # GIVEN a snapshot before a structure grows
    hoard: list = []
    old = heap.snapshot()
    # WHEN 20 000 dicts are added to it
    line = _grow(hoard, 20_000)
    sites = top_growth(old, heap.snapshot(), limit=5)
    # THEN the largest growth is at the line that allocated them, with about their size
    assert sites[0].where == f"{__file__}:{line}"
    assert sites[0].count_diff >= 20_000
    assert sites[0].size_diff > 20_000 * 64
    assert sites[0].stack[0] == sites[0].where


def test_growth_inside_the_standard_library_is_attributed_to_its_caller(heap):
    # GIVEN objects allocated by json.loads, called from this file
    hoard: list = []
    old = heap.snapshot()
    line = _grow_through_stdlib(hoard, 5_000)
    sites = top_growth(old, heap.snapshot(), limit=3)
    # THEN the site is the calling line here, while the stack still shows json's frames
    assert sites[0].where == f"{__file__}:{line}"
    assert any("json" in frame for frame in sites[0].stack)


def test_reading_counts_traced_bytes_and_none_once_stopped(heap):
    before = heap.read()
    hoard = [bytes(1000) for _ in range(1000)]
    assert heap.read() - before >= 1000 * 1000
    del hoard
    heap.close()
    if not tracemalloc.is_tracing():
        assert heap.read() is None and heap.snapshot() is None
