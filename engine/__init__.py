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
    "Bus",
    "EngineError",
    "OutOfBlocks",
    "ChecksumMismatch",
    "StorageError",
    "UnknownSequence",
    "FAULTS",
    "Faults",
]

_HOME = {
    "EngineConfig": "config",
    "PagedKVCache": "cache",
    "Bus": "bus",
    "EngineError": "errors",
    "OutOfBlocks": "errors",
    "ChecksumMismatch": "errors",
    "StorageError": "errors",
    "UnknownSequence": "errors",
    "FAULTS": "faults",
    "Faults": "faults",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value
