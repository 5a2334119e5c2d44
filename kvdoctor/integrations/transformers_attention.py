"""Attention statistics around a model's own attention function, registered with transformers' ``AttentionInterface``.

SDPA (transformers' default) returns no attention weights, so the tap computes what the attention
check needs itself, for each row's newest query only: one small matmul per layer, the query's last
position against the K the cache returned, then one batched pass per step over all layers for the
largest scaled score, the mean entropy over heads, the mass on the first ``block_size`` keys the
query may see (the sequence's first block; padding is masked out) and the count of non-finite scores.
The wrapped function is called with exactly the arguments it would have had, so outputs do not change.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["AttentionTap", "tap_name"]

_PREFIX = "kvdoctor_observe_"


def tap_name(original: str) -> str:
    """The name the tap around ``original`` ("sdpa", "eager" …) is registered under."""
    return _PREFIX + original


class AttentionTap:
    """Collects, during one forward pass, each layer's newest-query scores and the K length it saw."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stats = True  # False: record K lengths and shapes only
        self.active = False
        self.kv_len: dict[int, int] = {}  # layer -> keys its attention saw this pass
        self.shape: list[int] | None = None  # K shape of the first layer this pass, (B, H_kv, T, D)
        self._scores: list[tuple[int, torch.Tensor, Any, float]] = []  # (layer, (B, H, T) scores, mask, scale)

    def begin(self) -> None:
        self.active = True
        self.kv_len.clear()
        self.shape = None
        self._scores.clear()

    def wrap(self, original: str) -> Callable[..., Any]:
        """The attention function to register: ``original``'s, with the newest query's scores kept aside."""
        from transformers import AttentionInterface

        resolved = AttentionInterface().get_interface(original, None)  # None: "eager", the modeling file's own

        def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            fn = resolved or _eager_of(module)
            out = fn(module, query, key, value, attention_mask, *args, **kwargs)
            if self.active:
                self._observe(module, query, key, attention_mask, kwargs.get("scaling"))
            return out

        return attention

    def _observe(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, scaling: float | None) -> None:
        layer = getattr(module, "layer_idx", len(self.kv_len))
        self.kv_len[layer] = key.shape[-2]
        if self.shape is None:
            self.shape = list(key.shape)
        if not self.stats:
            return
        B, H, _, D = query.shape
        Hkv, T = key.shape[1], key.shape[-2]
        q = query[:, :, -1, :].reshape(B, Hkv, H // Hkv, D)  # (B, H_kv, G, D): each K head's query group
        scores = torch.matmul(q, key.transpose(-1, -2)).reshape(B, H, T)  # (B, H, T), unscaled
        if isinstance(mask, torch.Tensor):
            mask = mask[:, 0, -1, :] if mask.dim() == 4 else mask[..., -1, :]  # the newest query's row, (B, T)
        else:
            mask = None
        scale = scaling if scaling is not None else getattr(module, "scaling", D ** -0.5)
        self._scores.append((layer, scores, mask, float(scale)))

    def finish(self) -> list[tuple[int, list[list[float]]]]:
        """Per layer: per row [max_logit, entropy, sink, nonfinite] of the newest query; ends the pass."""
        self.active = False
        groups: dict[tuple, list] = {}
        for item in self._scores:
            groups.setdefault((item[1].shape, item[1].device), []).append(item)
        self._scores.clear()
        out: list[tuple[int, list[list[float]]]] = []
        for items in groups.values():
            out.extend(zip([i[0] for i in items], self._summarise(items)))
        return out

    def _summarise(self, items: list) -> list:
        scores = torch.stack([i[1] for i in items]).float()  # (L, B, H, T)
        scale = torch.tensor([i[3] for i in items], device=scores.device).view(-1, 1, 1, 1)
        scores = scores * scale
        L, B, _, T = scores.shape
        visible = torch.ones(L, B, 1, T, dtype=torch.bool, device=scores.device)
        for n, (_, _, mask, _) in enumerate(items):
            if mask is not None:
                ok = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
                visible[n, :, 0] = ok.expand(B, T)
        nonfinite = (~torch.isfinite(scores) & visible).sum(dim=(-1, -2))  # (L, B); masked -inf is expected
        s = scores.masked_fill(~visible, float("-inf"))
        heads_max = s.amax(dim=-1)  # (L, B, H)
        probs = torch.softmax(s, dim=-1)
        entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # (L, B, H) nats
        first = visible & (visible.cumsum(dim=-1) <= self.block_size)  # the first block of keys the query sees
        sink = (probs * first).sum(dim=-1)  # (L, B, H)
        summary = torch.stack([heads_max.amax(dim=-1), entropy.mean(dim=-1), sink.mean(dim=-1),
                               nonfinite.float()], dim=-1)  # (L, B, 4)
        return summary.tolist()


def _eager_of(module: Any) -> Callable[..., Any]:
    """The eager attention of the module's own modeling file (what transformers falls back to for "eager")."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        fn = sdpa_attention_forward
    return fn
