"""Importance eviction: keep each sequence within a KV budget by dropping the blocks attention needs least.

Two policies, both over whole blocks and both keeping the sink blocks (the first
``sink_blocks``, which a softmax leans on whatever the text) and the local window
(the newest ``local_blocks``):

* ``streaming`` — StreamingLLM (Xiao et al., 2024): a sliding window with sinks;
  the oldest block after the sinks goes first.
* ``h2o`` — Heavy-Hitter Oracle (Zhang et al., 2023): every block accumulates the
  attention probability it receives (summed over layers, heads and queries); the
  block with the least goes first.

Eviction goes through ``PagedKVCache.evict``, so every dropped block is an
``evict`` event with the policy as its reason, and the checks see a read of an
evicted block as the bug it would be.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .protocol import Step, StepFeature

__all__ = ["ImportanceEviction", "protected_blocks", "choose_victims"]


def protected_blocks(num_blocks: int, sink_blocks: int, local_blocks: int) -> set[int]:
    """Indices (position order among present blocks) that are never evicted: sinks and the local window."""
    return set(range(min(sink_blocks, num_blocks))) | set(range(max(num_blocks - local_blocks, 0), num_blocks))


def choose_victims(mode: str, scores: Sequence[float], budget: int, sink_blocks: int, local_blocks: int) -> list[int]:
    """Which present blocks (indices in position order) to evict so at most ``budget`` remain.

    ``scores`` are the blocks' accumulated attention (used by ``h2o``; ``streaming`` goes by age).
    Never returns a sink or a local-window block, so fewer come back when those alone exceed the budget.
    """
    n = len(scores)
    excess = n - budget
    if excess <= 0:
        return []
    keep = protected_blocks(n, sink_blocks, local_blocks)
    cands = [i for i in range(n) if i not in keep]
    if mode == "streaming":
        order = cands  # oldest first
    elif mode == "h2o":
        order = sorted(cands, key=lambda i: (scores[i], i))  # least attended first; the older among equals
    else:
        raise ValueError(f"importance mode {mode!r}: must be h2o or streaming")
    return sorted(order[:excess])


class ImportanceEviction(StepFeature):
    """Keeps every sequence of ``cache`` within ``budget_blocks``: after each step's commit, ``observe`` the attention
    mass the step's attention gave each block (``h2o``: ``Step.block_mass``), then ``enforce``."""

    def __init__(self, cache: Any, *, mode: str, budget_blocks: int, sink_blocks: int = 1, local_blocks: int = 1) -> None:
        if mode not in ("h2o", "streaming"):
            raise ValueError(f"importance mode {mode!r}: must be h2o or streaming")
        self.cache, self.mode, self.budget = cache, mode, budget_blocks
        self.sink_blocks, self.local_blocks = sink_blocks, local_blocks
        self._mass: dict[Any, dict[int, float]] = {}  # seq -> block id -> accumulated attention
        self.evicted = 0

    @classmethod
    def for_cache(cls, cache: Any) -> ImportanceEviction | None:
        c = cache.config
        if c.importance is None:
            return None
        return cls(cache, mode=c.importance, budget_blocks=c.kv_budget_blocks, sink_blocks=c.sink_blocks,
                   local_blocks=c.local_blocks)

    @property
    def wants_block_mass(self) -> bool:
        return self.mode == "h2o"

    def observe(self, seq: Any, block_ids: Sequence[int], mass: torch.Tensor) -> None:
        """Add the attention mass each block of ``seq`` received (``mass`` aligned with ``block_ids``)."""
        acc = self._mass.setdefault(seq, {})
        for b, m in zip(block_ids, mass.tolist()):
            acc[b] = acc.get(b, 0.0) + m

    def enforce(self, seqs: Sequence[Any]) -> list[int]:
        """Evict what each sequence holds beyond the budget; returns the evicted block ids."""
        out: list[int] = []
        for seq in seqs:
            ids = self.cache.block_table(seq)
            acc = self._mass.get(seq, {})
            victims = [ids[i] for i in choose_victims(self.mode, [acc.get(b, 0.0) for b in ids], self.budget,
                                                      self.sink_blocks, self.local_blocks)]
            if victims:
                self.cache.evict(victims, reason=self.mode)
                out.extend(victims)
            gone = set(victims)
            self._mass[seq] = {b: acc.get(b, 0.0) for b in ids if b not in gone}  # ids may be reused once freed
        self.evicted += len(out)
        return out

    def after_commit(self, step: Step) -> None:
        """The mass each layer's attention gave, folded in the order it was computed, then the budget."""
        for seq, block_ids, mass in step.block_mass or ():
            self.observe(seq, block_ids, mass)
        self.enforce(step.seqs)

    def forget(self, seq: Any) -> None:
        self._mass.pop(seq, None)
