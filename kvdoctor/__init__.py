"""kvdoctor: memory diagnostics and debugging for the KV cache of LLM inference.

Kept light on purpose: ``kvdoctor check --trace x`` must start without importing torch.
The engine lives in ``kvdoctor.engine``, the checks in ``kvdoctor.checks``.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "observe"]


def observe(model: Any, trace: Any = None, *, stats: bool = True) -> Any:
    """Record what ``model`` does to transformers' own caches as a kvdoctor trace (a context manager).

    ``with kvdoctor.observe(model, trace="run.kvtrace"): model.generate(...)``; without ``trace`` it
    writes to ``KVDOCTOR_TRACE``. See ``kvdoctor.integrations.transformers`` (imported here on first use,
    so ``import kvdoctor`` stays free of torch).
    """
    from .integrations.transformers import observe as _observe

    return _observe(model, trace, stats=stats)
