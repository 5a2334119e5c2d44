"""Rotary position embedding for the runner: cos/sin looked up by position, and the rotation itself."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RopeTable", "rope"]


class RopeTable:
    """A step's cos/sin looked up by position in a table the model's own rotary embedding made: two index ops
    where computing them is six to ten small torch ops, ~0.2 ms of a step once the step has streamed the
    weights through the caches. The same values, as each is computed from its position alone; RoPE kinds
    whose frequencies follow the sequence length ("dynamic", "longrope") are computed every step."""

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") not in ("dynamic", "longrope")
        self.cos = self.sin = None

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, D) at ``pos`` (N,), all below ``end``, in ``x``'s dtype."""
        if not self.static:
            cos, sin = self.rotary(x[None], pos[None])
            return cos[0], sin[0]
        if self.cos is None or end > self.cos.shape[0] or self.cos.dtype != x.dtype:
            size = max(end, 2 * (self.cos.shape[0] if self.cos is not None else 0), 256)
            cos, sin = self.rotary(x[None], torch.arange(size, device=x.device)[None])
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[pos], self.sin[pos]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (N, heads, D) with ``cos``, ``sin`` (N, 1, D): the same
    operations as transformers' ``apply_rotary_pos_emb`` for Llama-family models (rotate_half), so the
    same bits, applied to q and k heads in one pass."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
