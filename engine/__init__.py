"""kvdoctor's instrumented, tiered, paged KV-cache engine.

Importing the package is cheap (no torch): the public names below load their
module on first use, so ``kvdoctor check`` can import event-only code without
paying for the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EngineConfig",
    "PagedKVCache",
    "Runner",
    "SamplingParams",
    "Scheduler",
    "Request",
    "EngineCache",
    "load_model",
    "Bus",
    "errors",
    "EngineError",
    "OutOfBlocks",
    "ChecksumMismatch",
    "StorageError",
    "UnknownSequence",
    "CacheMisuse",
    "FAULTS",
    "Faults",
]

_HOME = {
    "EngineConfig": "config",
    "PagedKVCache": "kv.cache",
    "Runner": "serving.runner",
    "SamplingParams": "model.sampling",
    "Scheduler": "serving.scheduler",
    "Request": "serving.scheduler",
    "EngineCache": "model.hf",
    "load_model": "model.model",
    "Bus": "bus",
    "EngineError": "errors",
    "OutOfBlocks": "errors",
    "ChecksumMismatch": "errors",
    "StorageError": "errors",
    "UnknownSequence": "errors",
    "CacheMisuse": "errors",
    "FAULTS": "faults",
    "Faults": "faults",
}


def __getattr__(name: str) -> Any:
    if name == "errors":  # the typed errors as a module: kvdoctor.engine.errors.OutOfBlocks
        value: Any = importlib.import_module(".errors", __name__)
    elif name in _HOME:
        value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
