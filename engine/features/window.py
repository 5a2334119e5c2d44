"""Sliding-window attention: layers whose queries see only the newest ``window`` positions.

Mistral windows every layer; Qwen2 (``use_sliding_window``) and others list a type
per layer (``config.layer_types``: ``"sliding_attention"`` or ``"full_attention"``).
A windowed layer's query at position ``p`` sees keys at ``p - window + 1 … p``,
as transformers' ``sliding_window_overlay`` masks them, so the runner's tokens stay
identical to transformers' own ``generate``.

When *every* layer is windowed, a block whose last position has fallen behind the
window of the next query can never be read again: it is evicted (reason
``"window"``), so a long generation holds about ``window / block_size + 1`` blocks
per sequence instead of its whole history (as vLLM frees them). Only whole blocks
at the front go, so the blocks left are contiguous in position and the mask can be
built over them as if they started at position 0: a window is a relative distance.
With a mix of windowed and full layers nothing is evicted: the full layers need it all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..model.attention import AttnLayout
from .protocol import Group, Step, StepFeature

__all__ = ["SlidingWindow"]


@dataclass(eq=False)
class SlidingWindow(StepFeature):
    windows: tuple[int | None, ...]  # per layer: the window in tokens, or None for full attention
    changes_attention = True
    # the step's windowed masks by (queries per row, each row's keys): built once a step, shared by every windowed layer
    _layouts: dict[tuple, AttnLayout] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of_model(cls, config: Any) -> SlidingWindow | None:
        """The windows of a transformers config, or None when no layer is windowed."""
        window = getattr(config, "sliding_window", None)
        if not window:
            return None
        num_layers = config.num_hidden_layers
        types = getattr(config, "layer_types", None)
        if types is None:  # Mistral: one window for every layer
            windows: tuple[int | None, ...] = (int(window),) * num_layers
        else:
            windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
        if len(windows) != num_layers:
            raise ValueError(f"config lists {len(windows)} layer types for {num_layers} layers")
        return cls(windows) if any(w is not None for w in windows) else None

    def __post_init__(self) -> None:
        if len({w for w in self.windows if w is not None}) > 1:
            raise ValueError(f"layers with different windows {sorted(set(self.windows) - {None})} are not supported")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"a sliding window must be at least 1 token, got {self.windows}")

    @property
    def window(self) -> int:
        """The window of the windowed layers (one value: checked at construction)."""
        return next(w for w in self.windows if w is not None)

    @property
    def evicts(self) -> bool:
        """Whether blocks behind the window can be dropped: only when no layer attends to everything."""
        return all(w is not None for w in self.windows)

    def begin_step(self, step: Step) -> None:
        self._layouts.clear()

    def layout(self, layer: int, group: Group) -> AttnLayout | None:
        """A windowed layer's mask: each query sees the newest ``window`` keys up to its own."""
        if self.windows[layer] is None:
            return None
        key = (group.q_len, tuple(group.lens))
        built = self._layouts.get(key)
        if built is None:
            built = self._layouts[key] = AttnLayout.build([group.q_len] * len(group.rows), group.lens,
                                                          sink_tokens=group.sink_tokens, device=group.blocks.slots.device,
                                                          window=self.window)
        return built

    def dead_blocks(self, cache: Any, seq: Any) -> list[int]:
        """Blocks of ``seq`` that no later query will see: every position in them is at or before
        ``length - window``, the oldest position the next query (at ``length``) no longer sees."""
        s = cache.sequence(seq)
        oldest_seen = s.length - self.window + 1
        bs = cache.block_size
        # the newest block stays whatever the window: the next token is written there
        return [b.id for b in s.blocks[:-1] if (b.index + 1) * bs <= oldest_seen]

    def enforce(self, cache: Any, seqs: Sequence[Any]) -> list[int]:
        """Evict every block that fell behind the window (when every layer is windowed); returns their ids."""
        if not self.evicts:
            return []
        out: list[int] = []
        for seq in seqs:
            dead = self.dead_blocks(cache, seq)
            if dead:
                cache.evict(dead, reason="window")
                out.extend(dead)
        return out

    def after_commit(self, step: Step) -> None:
        self.enforce(step.cache, step.seqs)
