"""kvdoctor: memory diagnostics and debugging for the KV cache of LLM inference.

Kept light on purpose: ``kvdoctor check --trace x`` must start without importing torch.
The engine lives in ``kvdoctor.engine``, the checks in ``kvdoctor.checks``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
