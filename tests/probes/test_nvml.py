"""NVML probe: a machine without NVML is a state, not an error; per-process memory is this pid's."""

import os
from types import SimpleNamespace

import pynvml
import pytest

from kvdoctor.probes.nvml import Nvml


def test_missing_nvml_library_is_reported_not_raised(monkeypatch):
    # GIVEN a machine where the NVML shared library cannot be loaded
    def no_library():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    # WHEN the probe starts
    nvml = Nvml()
    # THEN it is unavailable with a reason a person understands, and reads nothing
    assert not nvml.available
    assert "NVML library not found" in nvml.reason
    assert nvml.read() is None
    nvml.close()


def test_driver_not_loaded_is_reported_with_its_reason(monkeypatch):
    def not_loaded():
        raise pynvml.NVMLError_DriverNotLoaded()

    monkeypatch.setattr(pynvml, "nvmlInit", not_loaded)
    nvml = Nvml()
    assert not nvml.available and nvml.reason.startswith("NVML could not start")


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two devices; this process uses 300 MiB on device 1, another process 1 GiB on device 0."""
    me, other = os.getpid(), os.getpid() + 100_000
    procs = {0: [SimpleNamespace(pid=other, usedGpuMemory=1 << 30)],
             1: [SimpleNamespace(pid=me, usedGpuMemory=300 << 20), SimpleNamespace(pid=other, usedGpuMemory=None)]}
    fake = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlSystemGetDriverVersion": lambda: b"550.54",
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: f"Fake GPU {h}",
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=80 << 30, used=(2 << 30) * (h + 1), free=0),
        "nvmlDeviceGetComputeRunningProcesses": lambda h: procs[h],
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)


def test_reading_per_device_and_for_this_process(fake_gpus):
    # GIVEN two GPUs, this process on the second WHEN read
    nvml = Nvml()
    reading = nvml.read()
    # THEN each device has its totals, and only this pid's memory counts as the process's
    assert nvml.available and nvml.driver_version == "550.54"
    assert [(d.name, d.used, d.process_used) for d in reading.devices] == [
        ("Fake GPU 0", 2 << 30, None), ("Fake GPU 1", 4 << 30, 300 << 20)]
    assert reading.used == 6 << 30
    assert reading.process_used == 300 << 20
    nvml.close()
    assert not nvml.available


def test_real_nvml_when_present():
    # On a GPU machine this exercises the driver; elsewhere it shows the no-NVML path works unpatched.
    nvml = Nvml()
    if not nvml.available:
        assert nvml.reason
        pytest.skip(f"no NVML here: {nvml.reason}")
    reading = nvml.read()
    assert reading.devices and all(d.total > 0 for d in reading.devices)
    nvml.close()
