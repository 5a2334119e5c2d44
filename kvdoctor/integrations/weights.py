"""A digest of a model's weights, cheap enough to take whenever they may have changed.

It samples up to 64 elements spread over each parameter, and its last: an update of a whole tensor, as
every optimizer step and weight load is, changes it; an edit of one element between samples does not (the
honest limit). It costs one pass over the parameters' metadata and a few kB of reads, so producers take it
around what may change weights (a vLLM RPC, a generate call) rather than every step.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["weights_digest"]

_SAMPLES = 64


def weights_digest(model: Any) -> str:
    """A digest of a sample of every parameter of ``model`` (vLLM runs it on each worker by ``apply_model``)."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            continue
        step = max(1, n // _SAMPLES)
        sample = flat[::step][:_SAMPLES]
        h.update(name.encode())
        h.update(sample.float().cpu().numpy().tobytes())
        h.update(flat[-1:].float().cpu().numpy().tobytes())
    return h.hexdigest()
