"""Which blocks to demote (or, in the last tier, evict) when a tier is full.

A policy only ranks candidates; the tier manager decides what is a candidate
(never a block of a sequence the current step uses, never one with a swap in
flight) and what happens to the chosen ones.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable, Protocol, Sequence

from ..config import EngineConfig
from .pool import Block

__all__ = ["EvictionPolicy", "LRUPolicy", "HybridPolicy", "Importance", "make_policy", "IMPORTANCE_DECAY"]

IMPORTANCE_DECAY = 0.9  # per observation: attention mass older than ~10 observations fades out


class Importance:
    """The attention mass each block got, decayed per observation: what the hybrid policy and mixed resolution
    rank blocks by. A side table by block id (``BlockPool.track`` empties it of a dropped block); a block never
    observed has 0."""

    def __init__(self) -> None:
        self.mass: dict[int, float] = {}

    def observe(self, blocks: Sequence[Block], scores: Sequence[float]) -> None:
        """Fold in the mass ``scores[i]`` that ``blocks[i]`` got in one observation."""
        mass = self.mass
        for b, w in zip(blocks, scores):
            mass[b.id] = mass.get(b.id, 0.0) * IMPORTANCE_DECAY + float(w)

    def of(self, b: Block) -> float:
        return self.mass.get(b.id, 0.0)

    def forget(self, block_id: int) -> None:
        self.mass.pop(block_id, None)


class EvictionPolicy(Protocol):
    name: str

    def victims(self, candidates: Iterable[Block], n: int, now: int, distance: Callable[[Block], float]) -> list[Block]:
        """The ``n`` candidates to move out first (fewer if there are fewer candidates).

        ``distance(b)`` is the block's distance from its sequence's newest token over the
        sequence's length, in [0, 1]; ``now`` is the cache tick that ``last_access`` counts in.
        """
        ...


class LRUPolicy:
    """Least recently used first; among equals, the block furthest from its sequence's end."""

    name = "lru"

    def victims(self, candidates: Iterable[Block], n: int, now: int, distance: Callable[[Block], float]) -> list[Block]:
        return heapq.nsmallest(n, candidates, key=lambda b: (b.last_access, -b.index, b.id))


class HybridPolicy:
    """Score = recency weight x age + distance weight x relative position distance
    - importance weight x accumulated attention importance; the highest scores go first.

    Each term is scaled to [0, 1] over the candidates, so the weights compare like
    for like: age against the oldest candidate, distance as the block's distance from
    its sequence's newest token over the sequence length (sinks and recent tokens stay
    close), importance against the most attended candidate.
    """

    name = "hybrid"

    def __init__(self, recency: float, distance: float, importance: float, mass: Importance) -> None:
        self.w_recency, self.w_distance, self.w_importance = recency, distance, importance
        self.importance = mass

    def victims(self, candidates: Iterable[Block], n: int, now: int, distance: Callable[[Block], float]) -> list[Block]:
        cands = list(candidates)
        if not cands:
            return []
        max_age = max(now - b.last_access for b in cands) or 1
        of = self.importance.of
        max_imp = max(of(b) for b in cands) or 1.0

        def score(b: Block) -> float:
            return (
                self.w_recency * (now - b.last_access) / max_age
                + self.w_distance * distance(b)
                - self.w_importance * of(b) / max_imp
            )

        return heapq.nlargest(n, cands, key=lambda b: (score(b), b.id))


def make_policy(config: EngineConfig, importance: Importance) -> EvictionPolicy:
    if config.eviction == "hybrid":
        return HybridPolicy(config.recency_weight, config.distance_weight, config.importance_weight, importance)
    return LRUPolicy()
