"""What computes K/V in vLLM, watched from the engine core: a ``weights`` event when the weights change.

RL and serving frameworks change a running engine's weights through the engine core's utilities:
``LLM.apply_model``, ``LLM.collective_rpc`` (``load_weights``, weight-sync worker extensions), sleep and
wake-up. Each of them runs in the engine core's process, whichever process holds the model, so the plugin
wraps them there (class-level, for every ``EngineCore``) and, around each call, asks the workers for a
digest of a fixed sample of every parameter (vLLM's own ``apply_model`` on the workers, so it works with
in-process and multi-process executors alike): a digest that differs after the call is a new weights
version in the scheduler's trace. A call that changes nothing (an RPC reading the model) gives no event.

The digest is ``weights.weights_digest``. vLLM's CPU
backend packs the linear layers' weights into oneDNN handles at load and empties their parameters: there
the digest sees embeddings and norms only (and an in-place edit of a packed layer changes nothing either).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from .guard import Call, positions
from .weights import weights_digest

__all__ = ["patch_engine_core", "tracer_of"]

# EngineCore utilities after which the weights may differ, and the cause each stands for
_UTILITIES = {"collective_rpc": "update", "wake_up": "wake"}


def _rpc_name(call: Call) -> str:
    """What an RPC ran: its method's name, or the user's function ``apply_model`` was given (what changed the
    weights)."""
    method = call["method"]
    if isinstance(method, str):
        inner = call["args"] or ()
        if method == "apply_model" and inner:
            return f"apply_model({getattr(inner[0], '__qualname__', type(inner[0]).__name__)})"
        return method
    return getattr(method, "__qualname__", type(method).__name__)


def patch_engine_core(engine_core_cls: type) -> None:
    """Wrap ``engine_core_cls``'s utilities once; each finds the tracer its scheduler carries, if any."""
    if getattr(engine_core_cls, "_kvdoctor_weights", False):
        return
    for name, cause in _UTILITIES.items():
        if hasattr(engine_core_cls, name):
            setattr(engine_core_cls, name, _watched(getattr(engine_core_cls, name), name, cause))
    engine_core_cls._kvdoctor_weights = True


def _watched(original: Callable, name: str, cause: str) -> Callable:
    arguments = positions(original)  # of the unbound function: ``self`` is argument 0

    def utility(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracer = tracer_of(self)
        if tracer is None:
            return original(self, *args, **kwargs)
        part, digest = f"EngineCore.{name}", lambda: _digest(self)
        before = tracer.guard.attempt(part, tracer.weights_baseline, digest)
        result = original(self, *args, **kwargs)
        if before is not None:
            tracer.guard.attempt(part, tracer.weights_after, digest, cause,
                                 lambda: f"{name}({_rpc_name(Call(arguments, (self, *args), kwargs))!r})"
                                 if name == "collective_rpc" else name)
        return result

    utility.__wrapped__ = original  # type: ignore[attr-defined]
    return utility


def tracer_of(engine_core: Any) -> Any:
    try:
        return getattr(engine_core.scheduler, "_kvdoctor", None)
    except Exception:  # an engine core without a scheduler yet: nothing traced there
        return None


def _digest(engine_core: Any) -> str:
    """One digest over every worker's (tensor- and pipeline-parallel ranks each hold a part)."""
    parts = engine_core.model_executor.collective_rpc("apply_model", args=(weights_digest,))
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()
