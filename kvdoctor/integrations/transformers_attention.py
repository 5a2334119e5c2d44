"""Attention statistics around a model's own attention function, registered with transformers' ``AttentionInterface``.

SDPA (transformers' default) returns no attention weights, so the tap computes what the attention
check needs itself, for each row's newest query only. Per layer it does only what needs that layer's
K, in as few tensor operations as it takes: one small batched product of the query's last position
with the K the cache returned (views, no copies, while decoding). Once per step, layers sharing a
mask are summarised together (the mask read once): the largest scaled score, the mean entropy over
heads, the mass on the first ``block_size`` keys the query may see (the sequence's first block;
padding is masked out), and the count of non-finite scores, made only when a statistic is non-finite.
Per step that is a fixed number of operations and one copy to Python, whatever the number of layers.
On a pass that writes padding slots (a padded batch's prefill) it also counts, per layer, the non-finite
K/V written there (``padding``). The wrapped function is called with exactly the arguments it would have
had, so outputs do not change."""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch

__all__ = ["AttentionTap", "newest_query_stats", "tap_name"]

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
        self._scores: list[tuple] = []  # (layer, (B*H_kv, G, T) scores, 4D mask or None, scale, B, H)
        self._pad: tuple[int, torch.Tensor] | None = None  # (first new slot, (B, new) bool: padding) this pass
        self._pad_bad: list[tuple[int, torch.Tensor]] = []  # (layer, (B,) non-finite K/V values in padding slots)
        self.on_error: Callable[[str, BaseException], None] = lambda part, exc: None  # the observer's guard

    def begin(self, padding: tuple[int, torch.Tensor] | None = None) -> None:
        """A pass starts; ``padding``: (its first new slot, (B, new) bool of the new slots that are padding),
        when it writes any."""
        self.active = True
        self.kv_len.clear()
        self.shape = None
        self._scores.clear()
        self._pad = padding
        self._pad_bad.clear()

    def wrap(self, original: str) -> Callable[..., Any]:
        """The attention function to register: ``original``'s, with the newest query's scores kept aside."""
        from transformers import AttentionInterface

        resolved = AttentionInterface().get_interface(original, None)  # None: "eager", the modeling file's own

        def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            fn = resolved or _eager_of(module)
            out = fn(module, query, key, value, attention_mask, *args, **kwargs)
            if self.active:
                try:
                    if self._pad is not None:
                        self._padding(module, key, value)
                    self._observe(module, query, key, attention_mask, kwargs.get("scaling"))
                except Exception as exc:  # never into the model: the observer records it and stops
                    self.active = False
                    self.on_error("attention", exc)
            return out

        return attention

    def _observe(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, scaling: float | None) -> None:
        layer = getattr(module, "layer_idx", len(self.kv_len))
        B, Hkv, T, D = key.shape
        self.kv_len[layer] = T
        if self.shape is None:
            self.shape = [B, Hkv, T, D]
        if not self.stats:
            return
        H = query.shape[1]
        newest = query if query.shape[2] == 1 else query[:, :, -1]  # decoding: the query is the newest one
        q = newest.reshape(B * Hkv, H // Hkv, D)  # (B*H_kv, G, D): each K head's query group (a view while decoding)
        scores = torch.bmm(q, key.reshape(B * Hkv, T, D).transpose(1, 2))  # (B*H_kv, G, T), unscaled
        scale = scaling if scaling is not None else getattr(module, "scaling", D ** -0.5)
        self._scores.append((layer, scores, mask if isinstance(mask, torch.Tensor) else None, float(scale), B, H))

    def _padding(self, module: Any, key: torch.Tensor, value: torch.Tensor) -> None:
        """Count the non-finite K/V this layer's pass wrote into each row's padding slots."""
        first, pad = self._pad
        n, T = pad.shape[1], key.shape[2]
        lo = first if first + n <= T else T - n  # a sliding layer may hold only the newest slots
        bad = (~torch.isfinite(key[:, :, lo: lo + n])).sum(dim=(1, 3)) + \
            (~torch.isfinite(value[:, :, lo: lo + n])).sum(dim=(1, 3))  # (B, new)
        self._pad_bad.append((getattr(module, "layer_idx", len(self._pad_bad)), (bad * pad).sum(dim=1)))

    def padding(self) -> list[tuple[int, int | None]] | None:
        """Per row, (non-finite K/V values written into its padding slots at the first layer with any, that
        layer) or (0, None); None when the pass wrote no padding."""
        if self._pad is None or not self._pad_bad:
            return None
        layers = [layer for layer, _ in self._pad_bad]
        counts = torch.stack([c for _, c in self._pad_bad]).tolist()  # (L, B): one copy to Python
        out: list[tuple[int, int | None]] = []
        for b in range(len(counts[0])):
            hit = next(((c[b], layer) for layer, c in zip(layers, counts) if c[b]), (0, None))
            out.append(hit)
        return out

    def finish(self) -> list[tuple[int, list[list[float]]]]:
        """Per layer: per row [max_logit, entropy, sink, nonfinite] of the newest query; ends the pass.
        Layers sharing a score shape, a mask object and a scale (usually all full-attention ones) go together."""
        self.active = False
        groups: dict[tuple, list] = {}
        for item in self._scores:
            groups.setdefault((item[1].shape, id(item[2]), item[3]), []).append(item)
        self._scores.clear()
        out: list[tuple[int, list[list[float]]]] = []
        for items in groups.values():
            out.extend(zip([i[0] for i in items], self._summarise(items)))
        return out

    def _summarise(self, items: list) -> list:
        _, _, mask, scale, B, H = items[0]
        T = items[0][1].shape[-1]
        raw = torch.stack([i[1] for i in items]).view(len(items), B, H, T)  # (L, B, H, T), unscaled
        visible = None
        if mask is not None:
            row = mask[:, 0, -1, :T] if mask.dim() == 4 else mask[..., -1, :T]  # the newest query's mask row, (B|1, T)
            visible = (row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2).expand(B, T)
        return newest_query_stats(raw, scale, visible, self.block_size)


def newest_query_stats(raw: torch.Tensor, scale: float, visible: torch.Tensor | None, block_size: int
                       ) -> list[list[list[float]]]:
    """Per layer and row ``[max_logit, entropy, sink, nonfinite]`` of the newest query, from its unscaled
    scores ``raw`` (L, B, H, T) and the keys it sees, ``visible`` (B, T) bool (None: all of them).

    The sink is the mass on the first ``block_size`` keys the query sees (left padding is not the
    sequence's first block). tests/test_attention_statistics.py holds this, the engine's torch passes
    and its compiled kernel to one reference."""
    L, B, H, T = raw.shape
    scores = (raw if raw.dtype == torch.float32 else raw.float()) * scale
    if visible is not None:
        visible = visible.reshape(1, B, 1, T)
        scores = scores.masked_fill(~visible, float("-inf"))
    heads_max = scores.amax(dim=-1)  # (L, B, H)
    logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    if visible is not None:  # a masked key: probability 0, log -inf; its term of the entropy is 0
        logp = logp.masked_fill(~visible, 0.0)
        sink = (probs * (visible & (visible.cumsum(dim=-1) <= block_size))).sum(dim=-1)  # the first block it sees
    else:
        sink = probs[..., :block_size].sum(dim=-1)  # (L, B, H)
    entropy = (probs * logp).sum(dim=-1)  # (L, B, H), minus the entropy in nats
    summary = torch.stack([heads_max.amax(dim=-1), entropy.mean(dim=-1).neg_(), sink.mean(dim=-1)],
                          dim=-1).tolist()  # (L, B, 3)
    # A seen score that is NaN or infinite makes its row's largest score or entropy non-finite (NaN
    # poisons the softmax, +inf the maximum, -inf a 0 * -inf term), so they are counted only then.
    if all(math.isfinite(r[0] + r[1]) for rows in summary for r in rows):
        for rows in summary:
            for r in rows:
                r.append(0)
    else:
        bad = ~torch.isfinite(raw)
        counts = (bad if visible is None else bad & visible).sum(dim=(-1, -2)).tolist()  # (L, B)
        for rows, row_counts in zip(summary, counts):
            for r, n in zip(rows, row_counts):
                r.append(n)
    return summary


def _eager_of(module: Any) -> Callable[..., Any]:
    """The eager attention of the module's own modeling file (what transformers falls back to for "eager")."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        fn = sdpa_attention_forward
    return fn
