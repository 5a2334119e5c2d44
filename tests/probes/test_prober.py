"""The Prober: mem events on the engine's bus, at an interval and on demand, into a run's trace."""

import tracemalloc
from types import SimpleNamespace

import pytest

from kvdoctor.engine.bus import Bus
from kvdoctor.errors import UsageError
from kvdoctor.events import Header, Mem, SeqStart, StepEnd, TierSpec
from kvdoctor.probes import ENV_HEAP, ENV_INTERVAL, ENV_PROBES, attach_probes, attach_to_cache, from_env
from kvdoctor.trace import TraceReader, TraceWriter

ACCOUNTING = {"device": 4096, "host": 1024, "disk": 512}


@pytest.fixture
def bus():
    bus, seen = Bus(), []
    bus.subscribe(seen.extend)
    bus.seen = seen
    return bus


def _mems(events):
    return [e for e in events if isinstance(e, Mem)]


def test_first_reading_at_attach_then_one_per_interval(bus):
    # GIVEN probes with an interval no step outlasts
    prober = attach_probes(bus, lambda: ACCOUNTING, interval_s=3600)
    try:
        for _ in range(5):
            bus.end_step(1)
        # THEN only the reading taken at attach is there
        assert [m.source for m in _mems(bus.seen)] == ["start"]
        # WHEN the interval is shorter than a step THEN every step boundary takes one
        prober.interval_s = 1e-9
        for _ in range(3):
            bus.end_step(1)
        bus.flush()
        assert [m.source for m in _mems(bus.seen)] == ["start", "interval", "interval", "interval"]
    finally:
        prober.detach()


def test_reading_fields_add_up(bus):
    prober = attach_probes(bus, lambda: ACCOUNTING, device_on_cpu=True, heap=True)
    try:
        bus.flush()
        (mem,) = _mems(bus.seen)
        # THEN the engine's figures come from its accounting; unaccounted is what remains of RSS
        assert mem.kv_bytes == 4096 + 1024 + 512
        assert mem.torch_cpu == 4096 + 1024  # device and host live in host memory; disk is files
        assert mem.rss > 0 and mem.py_heap > 0
        assert mem.unaccounted == mem.rss - mem.py_heap - mem.torch_cpu
        assert prober.last.to_dict()["kv_by_tier"] == ACCOUNTING
    finally:
        prober.detach()


def test_on_demand_reading_says_why(bus):
    prober = attach_probes(bus, None)
    try:
        reading = prober.read_now("finding:leak/unfreed")
        bus.flush()
        assert _mems(bus.seen)[-1].source == "finding:leak/unfreed"
        assert _mems(bus.seen)[-1].py_heap is None and reading.engine is None
    finally:
        prober.detach()


def test_detach_stops_readings_and_the_tracing_it_started(bus):
    was_tracing = tracemalloc.is_tracing()
    prober = attach_probes(bus, None, interval_s=1e-9, heap=True)
    prober.detach()
    bus.end_step(1)
    assert len(_mems(bus.seen)) == 1
    assert tracemalloc.is_tracing() == was_tracing


def test_interval_must_be_positive(bus):
    with pytest.raises(ValueError, match="interval_s"):
        attach_probes(bus, None, interval_s=0)


def test_mem_events_are_in_the_run_trace_in_time_order(tmp_path):
    # GIVEN a bus writing a trace, with probes attached
    path = tmp_path / "run.kvtrace"
    header = Header(block_size=16, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=8)])
    bus = Bus()
    with TraceWriter(path, header) as writer:
        bus.subscribe(writer.write_many)
        prober = attach_probes(bus, lambda: ACCOUNTING, interval_s=1e-9)
        # WHEN the engine runs a few steps
        for step in range(4):
            bus.emit(SeqStart, seq=step, prompt_len=3)
            bus.end_step(3)
        prober.detach()
    events = list(TraceReader(path))
    # THEN the trace holds the readings, and t never decreases across them
    mems = _mems(events)
    assert len(mems) >= 4 and all(m.rss > 0 and m.kv_bytes == 5632 for m in mems)
    assert [e.t for e in events] == sorted(e.t for e in events)
    assert sum(isinstance(e, StepEnd) for e in events) == 4


class _Cache:
    """The slice of ``PagedKVCache`` the probes use: ``bus``, ``config.is_cuda``, ``stats()``."""

    def __init__(self, is_cuda=False):
        self.config = SimpleNamespace(is_cuda=is_cuda)
        self.bus = Bus()
        self.bus.subscribe(lambda events: None)

    def stats(self):
        return {"tiers": {"device": {"used_bytes": 64, "arena_bytes": 128},
                          "host": {"used_bytes": 32, "arena_bytes": 256}}}


def test_env_switches_probes_on_for_a_cache(monkeypatch):
    monkeypatch.delenv(ENV_PROBES, raising=False)
    assert from_env(_Cache()) is None
    monkeypatch.setenv(ENV_PROBES, "1")
    monkeypatch.setenv(ENV_INTERVAL, "0.25")
    prober = from_env(_Cache())
    try:
        assert prober.interval_s == 0.25 and prober.heap is None  # tracemalloc only when asked for
        assert prober.last.engine.kv == 96 and prober.last.engine.cpu_tensors == 384
    finally:
        prober.detach()


def test_env_can_ask_for_tracemalloc(monkeypatch):
    monkeypatch.setenv(ENV_PROBES, "1")
    monkeypatch.setenv(ENV_HEAP, "1")
    prober = from_env(_Cache())
    try:
        assert prober.heap is not None and prober.last.py_heap is not None
    finally:
        prober.detach()


@pytest.mark.parametrize("name,value", [(ENV_PROBES, "maybe"), (ENV_HEAP, "2"), (ENV_INTERVAL, "0"), (ENV_INTERVAL, "fast")])
def test_bad_env_values_are_usage_errors_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(ENV_PROBES, "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=name):
        from_env(_Cache())


def test_attach_to_cache_knows_a_gpu_device_tier_is_not_host_memory():
    prober = attach_to_cache(_Cache(is_cuda=True), heap=False)
    try:
        assert prober.last.engine.cpu_tensors == 256
    finally:
        prober.detach()
