"""Which adapter computes K/V in vLLM: ``adapter`` events for LoRA loads, reloads and unloads (each request's
adapter, cache salt and other prefix-key parts are on its ``seq_start``, which the tracer writes).

A LoRA changes K and V of every layer it adapts, so a block's identity includes the adapter that computed it:
its name, vLLM's id and which contents that id held then. vLLM's prefix-cache key carries the name and path
only, so an adapter reloaded in place under the same name and path (``load_inplace``: the RL LoRA sync, vllm PR
#42495), or two adapters with one name and different ids (vllm #30931), hit each other's blocks. The engine core
(the scheduler's process) sees every way an adapter reaches the workers:

- ``EngineCore.add_lora`` / ``remove_lora`` (``LLM.llm_engine.add_lora``, the server's ``/v1/load_lora_adapter``);
- a request naming an adapter the workers do not hold, or with ``load_inplace`` (the worker loads it before the
  request's first step: ``LRUCacheWorkerLoRAManager.add_adapter``).

Each of them is a load only when it changes what the id holds: a fingerprint of the adapter's files (names,
sizes, their first and last 64 KiB: a training step changes every tensor) that differs from the last one seen
for the id is a new ``load`` number; the same contents loaded again (an unload and add, ``load_inplace`` of unchanged files) keep
it, since their K/V are the same. An adapter vLLM resolves from elsewhere than a local path (a hub id) is
fingerprinted by its path alone. The honest limit: an adapter the worker's LRU dropped and reloaded from files
changed meanwhile is not seen.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..events import Adapter
from .guard import Call, positions
from .vllm_weights import tracer_of

__all__ = ["watch_adapters", "AdapterLoads", "fingerprint"]

_SAMPLE = 64 * 1024  # bytes read into the fingerprint from each end of each file


def watch_adapters(tracer: Any, engine_core_cls: type) -> None:
    """Adapters as part of ``tracer``'s trace: its scheduler's requests say theirs, the engine core's LoRA
    utilities (wrapped once per class) say what the workers load. A failure here stops the tracer, not vLLM."""
    tracer.guard.attempt("start-up (adapters)", _watch, tracer, engine_core_cls)


def _watch(tracer: Any, engine_core_cls: type) -> None:
    loads = AdapterLoads(tracer._emit)
    tracer.scheduler._kvdoctor_adapters = loads

    def added(call: Call, _: Any, __: Any) -> None:
        request = call["request"]
        lora = request.lora_request
        if lora is not None:  # before the request's first step, when the worker loads what it names
            loads.requested(lora, f"request {request.request_id!r}")

    tracer._wrap(tracer.scheduler, "add_request", after=added)  # over the tracer's own: after its seq_start
    _patch_utilities(engine_core_cls)


@dataclass
class _Held:
    name: str
    path: str
    digest: str
    load: int


class AdapterLoads:
    """What the workers hold under each LoRA id, as far as the engine core can tell, and the events it makes."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self._emit = emit
        self._last: dict[Any, _Held] = {}  # id -> the contents it last held (kept after an unload: a load number)
        self._held: set[Any] = set()  # ids the workers hold now

    def requested(self, lora: Any, detail: str) -> None:
        """``lora`` reaches the workers: a load where they lack its id or it is loaded in place."""
        inplace = bool(getattr(lora, "load_inplace", False))
        if lora.lora_int_id in self._held and not inplace:
            return
        self.loaded(lora, f"{detail} (load_inplace)" if inplace else detail)

    def loaded(self, lora: Any, detail: str) -> None:
        key, name, path = lora.lora_int_id, lora.lora_name, lora.lora_path
        digest = fingerprint(path)
        last = self._last.get(key)
        same = last is not None and last.digest == digest and last.name == name
        if same and key in self._held:
            return
        held = self._last[key] = last if same else _Held(name, path, digest, last.load + 1 if last else 1)
        op = "reload" if key in self._held else "load"
        self._held.add(key)
        self._emit(Adapter, op=op, name=name, adapter_id=key, load=held.load, path=path, detail=detail, digest=digest)

    def unloaded(self, key: Any, detail: str) -> None:
        held = self._last.get(key)
        if key in self._held and held is not None:
            self._held.discard(key)
            self._emit(Adapter, op="unload", name=held.name, adapter_id=key, load=held.load, path=held.path,
                       detail=detail, digest=held.digest)


def fingerprint(path: str) -> str:
    """A digest of what a LoRA path holds: every file's name and size, its first and last 64 KiB. Not the
    modification time: files rewritten with the same bytes compute the same K/V."""
    h = hashlib.blake2b(path.encode(), digest_size=8)
    if os.path.isdir(path):
        files = sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
    else:
        files = [path] if os.path.isfile(path) else []
    for name in files:
        size = os.path.getsize(name)
        h.update(f"{os.path.relpath(name, path)}:{size}".encode())
        with open(name, "rb") as f:
            h.update(f.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                f.seek(size - _SAMPLE)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _patch_utilities(engine_core_cls: type) -> None:
    """``add_lora``/``remove_lora`` of every engine core; each finds its scheduler's tracer, if any."""
    if getattr(engine_core_cls, "_kvdoctor_adapters", False):
        return
    for name in ("add_lora", "remove_lora"):
        if hasattr(engine_core_cls, name):
            setattr(engine_core_cls, name, _watched(getattr(engine_core_cls, name), name))
    engine_core_cls._kvdoctor_adapters = True


def _watched(original: Callable, name: str) -> Callable:
    arguments = positions(original)  # of the unbound function: ``self`` is argument 0

    def utility(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        tracer = tracer_of(self)
        loads = getattr(getattr(self, "scheduler", None), "_kvdoctor_adapters", None)
        if tracer is not None and loads is not None and result:
            call = Call(arguments, (self, *args), kwargs)
            if name == "add_lora":
                tracer.guard.attempt(f"EngineCore.{name}", lambda: loads.requested(call["lora_request"], name))
            else:
                tracer.guard.attempt(f"EngineCore.{name}", lambda: loads.unloaded(call["lora_id"], name))
        return result

    utility.__wrapped__ = original  # type: ignore[attr-defined]
    return utility
