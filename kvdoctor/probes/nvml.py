"""GPU memory as the driver sees it, through nvidia-ml-py (NVML).

NVML knows what torch cannot: memory used by other processes, the CUDA context,
and a device's total. Without an NVIDIA driver the library is simply absent; that
is a normal state of a machine ("no NVML"), reported with its reason, never raised.
Inside a container NVML may list processes by host PIDs, so this process's entry
can be missing; ``process_used`` is then None rather than a guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DeviceMemory", "NvmlReading", "Nvml"]


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    name: str
    total: int
    used: int  # by every process on the device
    process_used: int | None  # by the watched process, when NVML reports it


@dataclass(frozen=True)
class NvmlReading:
    devices: list[DeviceMemory]

    @property
    def used(self) -> int:
        return sum(d.used for d in self.devices)

    @property
    def process_used(self) -> int | None:
        known = [d.process_used for d in self.devices if d.process_used is not None]
        return sum(known) if known else None


class Nvml:
    """One NVML session. ``available`` is False, with ``reason`` saying why, where NVML cannot run."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.reason: str | None = None
        self.driver_version: str | None = None
        self._handles: list = []
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py is a dependency; a broken install still must not crash
            self.reason = f"nvidia-ml-py is not importable ({exc})"
            return
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            self.reason = "NVML library not found (no NVIDIA driver on this machine)"
            return
        except pynvml.NVMLError as exc:
            self.reason = f"NVML could not start: {exc}"
            return
        try:
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
        except pynvml.NVMLError as exc:
            self.reason = f"NVML could not list devices: {exc}"
            pynvml.nvmlShutdown()
            self._handles = []

    @property
    def available(self) -> bool:
        return self.reason is None

    def read(self) -> NvmlReading | None:
        if not self.available:
            return None
        nvml = self._nvml
        devices = []
        for index, handle in enumerate(self._handles):
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(DeviceMemory(
                index=index, name=self._names[index], total=int(info.total), used=int(info.used),
                process_used=self._process_used(handle),
            ))
        return NvmlReading(devices=devices)

    def _process_used(self, handle) -> int | None:
        nvml = self._nvml
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError:
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory is not None]
        return int(sum(mine)) if mine else None

    def close(self) -> None:
        if self.available:
            self._nvml.nvmlShutdown()
            self.reason = "closed"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
