"""Attention over K/V gathered from the engine's blocks, with statistics taken from the scores it computes.

Grouped-query attention runs on the key/value heads without repeating K and V:
the ``H`` query heads are folded into ``H_kv`` groups of ``H / H_kv``. Rows of a
batch may have different query and key lengths; ``AttnLayout`` holds the padding
mask once per step so every layer reuses it.

When statistics are due, attention is computed explicitly (scores, softmax,
weighted sum) and the statistics of each row's newest query come from those very
scores: the largest scaled logit, the mean over heads of the Shannon entropy in
nats, the probability mass on the sequence's first block (attention sinks), and
the number of non-finite scores or probabilities. When they are not due, the
cheap path is PyTorch's fused ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["AttnLayout", "AttnStats", "attend", "STAT_FIELDS"]

STAT_FIELDS = ("max_logit", "entropy", "sink", "nonfinite")


@dataclass(frozen=True)
class AttnLayout:
    """Where the valid queries and keys of a padded batch are; built once per step.

    Row ``b`` has ``q_lens[b]`` queries at positions ``kv_lens[b] - q_lens[b]`` … ``kv_lens[b] - 1``
    and ``kv_lens[b]`` keys at positions ``0`` … ``kv_lens[b] - 1``; each query sees the keys
    at or before its own position.
    """

    allowed: torch.Tensor | None  # (B, 1, S, T) bool, or None when no row needs masking
    last_query: torch.Tensor  # (B,) index of each row's newest query within S
    sink_tokens: int
    causal: bool  # no mask, and the queries are the whole fresh sequence: query i sees keys 0 … i

    @classmethod
    def build(
        cls, q_lens: list[int], kv_lens: list[int], *, sink_tokens: int, device: torch.device | str = "cpu"
    ) -> AttnLayout:
        if len(q_lens) != len(kv_lens) or not q_lens:
            raise ValueError(f"q_lens {q_lens} and kv_lens {kv_lens} must be non-empty and of equal length")
        if any(q < 1 or q > t for q, t in zip(q_lens, kv_lens)):
            raise ValueError(f"every row needs 1 <= q_len <= kv_len, got q_lens {q_lens} kv_lens {kv_lens}")
        S, T = max(q_lens), max(kv_lens)
        uniform = len(set(q_lens)) == 1 and len(set(kv_lens)) == 1
        allowed = None
        # One query per row over equal lengths, or a fresh causal prefill, needs no explicit mask.
        if not (uniform and (S == 1 or S == T)):
            q_idx = torch.arange(S, device=device)
            k_idx = torch.arange(T, device=device)
            q_len = torch.tensor(q_lens, device=device)
            kv_len = torch.tensor(kv_lens, device=device)
            q_pos = (kv_len - q_len)[:, None] + q_idx[None, :]  # (B, S) absolute position of each query
            allowed = (k_idx[None, None, :] <= q_pos[:, :, None]) & (k_idx[None, None, :] < kv_len[:, None, None])
            allowed &= (q_idx[None, :] < q_len[:, None])[:, :, None]
            # A padded query row sees key 0 only, so its softmax stays finite (its output is discarded).
            allowed[:, :, 0] |= ~(q_idx[None, :] < q_len[:, None])
            allowed = allowed[:, None]  # (B, 1, S, T)
        last = torch.tensor([q - 1 for q in q_lens], device=device)
        return cls(allowed, last, sink_tokens, allowed is None and S > 1)

    @classmethod
    def from_mask(cls, allowed: torch.Tensor | None, batch: int, q_len: int, *, sink_tokens: int) -> AttnLayout:
        """The layout of a batch whose mask someone else built (transformers' boolean SDPA mask, or None).

        Every row's newest query is the last one, as in transformers' left-padded batches.
        """
        last = torch.full((batch,), q_len - 1, dtype=torch.long)
        if allowed is not None:
            allowed = allowed.expand(batch, 1, *allowed.shape[-2:])
            last = last.to(allowed.device)
        return cls(allowed, last, sink_tokens, allowed is None and q_len > 1)


@dataclass(frozen=True)
class AttnStats:
    """One layer's statistics per row, still as tensors: converted to numbers once per step, not per layer."""

    summary: torch.Tensor  # (B, 4) float32: max_logit, entropy, sink, nonfinite
    heads_entropy: torch.Tensor | None = None  # (B, H)
    heads_max_logit: torch.Tensor | None = None  # (B, H)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttnLayout,
    *,
    scale: float,
    stats: bool = False,
    per_head: bool = False,
    corrupt: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, AttnStats | None]:
    """Attention of ``q`` (B, H, S, D) over ``k``, ``v`` (B, H_kv, T, D); returns (B, H, S, D) and the statistics.

    ``stats=False`` takes the fused SDPA path and returns no statistics. ``corrupt`` sees the
    scaled scores ``(B, H, S, T)`` before the softmax (the attention-nan fault's hook) and
    forces the explicit path.
    """
    B, H, S, D = q.shape
    H_kv, T = k.shape[1], k.shape[2]
    if H % H_kv:
        raise ValueError(f"{H} query heads are not a multiple of {H_kv} key/value heads")
    if not stats and corrupt is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=layout.allowed, scale=scale, is_causal=layout.causal, enable_gqa=H != H_kv
        )
        return out, None
    g = H // H_kv
    qg = q.reshape(B, H_kv, g * S, D)  # query head h uses kv head h // g, as repeat_kv lays them out
    scores = (qg @ k.transpose(-1, -2)).mul_(scale).view(B, H_kv, g, S, T)  # (B, H_kv, g, S, T)
    if corrupt is not None:
        scores = corrupt(scores.view(B, H, S, T)).view(B, H_kv, g, S, T)
    if layout.allowed is not None:
        valid = layout.allowed[:, :, None]  # (B, 1, 1, S, T)
    elif layout.causal:
        valid = torch.ones(S, T, dtype=torch.bool, device=q.device).tril_(T - S)
    else:
        valid = None
    # The most negative finite value rather than -inf: a query row with every key masked (left
    # padding in transformers' batches) then averages V instead of turning the row into NaN.
    masked = scores if valid is None else scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    probs = torch.softmax(masked, dim=-1, dtype=torch.float32).to(q.dtype)
    out = (probs.view(B, H_kv, g * S, T) @ v).view(B, H, S, D)
    if not stats:
        return out, None
    return out, _row_stats(scores.view(B, H, S, T), probs.view(B, H, S, T), valid, layout, per_head)


def _row_stats(
    scores: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None, layout: AttnLayout, per_head: bool
) -> AttnStats:
    """Statistics of each row's newest query from the scores and probabilities already computed."""
    B, H, S, T = scores.shape
    rows = torch.arange(B, device=scores.device)
    last = layout.last_query
    s = scores[rows, :, last].float()  # (B, H, T)
    p = probs[rows, :, last].float()  # (B, H, T)
    if valid is None:
        keep = torch.ones(B, 1, T, dtype=torch.bool, device=s.device)
    elif valid.dim() == 2:  # causal (S, T): the newest query sees every key
        keep = valid[S - 1][None, None, :].expand(B, 1, T)
    else:
        keep = valid.reshape(B, S, T)[rows, last][:, None, :]  # (B, 1, T)
    finite_s = torch.isfinite(s)
    nonfinite = ((~finite_s | ~torch.isfinite(p)) & keep).sum(dim=(1, 2)).float()  # (B,)
    heads_max = torch.where(keep & finite_s, s, float("-inf")).amax(dim=-1)  # (B, H)
    heads_entropy = -torch.special.xlogy(p, p).where(keep, 0.0).sum(dim=-1)  # (B, H)
    sink = p[:, :, : layout.sink_tokens].sum(dim=-1).mean(dim=-1)  # (B,)
    summary = torch.stack([heads_max.amax(dim=-1), heads_entropy.mean(dim=-1), sink, nonfinite], dim=-1)
    if per_head:
        return AttnStats(summary, heads_entropy, heads_max)
    return AttnStats(summary)
