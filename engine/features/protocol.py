"""The step-feature protocol: how a KV feature joins the runner's steps without the runner naming it.

A step feature (block-sparse reads, importance eviction, sliding windows, token merging, long-context
streaming, and whatever comes next) is told when a step begins, after each layer's new K/V are stored,
and after the step's tokens are committed; and it says whether it changes what attention computes this
step. The runner holds the active features in one list, calls them in its order at each of these points,
and runs a decode step's compiled layers (``engine.model.decode_layer``) exactly when none of them changes
attention: nothing keeps a list of which features do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...events import SeqId

__all__ = ["Step", "StepFeature"]


@dataclass(frozen=True)
class Step:
    """What a feature may need to know of the step being computed."""

    seqs: Sequence[SeqId]  # the step's rows, in order
    cache: Any = None  # the ``PagedKVCache`` the step reads and writes
    plan: Any = None  # the cache's ``ReadPlan``: where every row's blocks are read from; a feature reads through it
    want_mass: bool = False  # the placement policy ranks blocks by the attention they get this step
    want_scores: bool = False  # attention statistics are taken this step


class StepFeature:
    """A feature of the runner's steps: the protocol, each point a no-op until a feature overrides it.

    ``changes_attention`` is read after ``begin_step``: a feature may change attention on some steps only
    (long context, on the steps that stream)."""

    changes_attention: bool = False  # attention computes something other than dense attention over the rows' blocks

    def begin_step(self, step: Step) -> None:
        """Before the first layer: the step's rows, their blocks and what is wanted of attention are known."""

    def after_store(self, layer: int, seqs: Sequence[SeqId]) -> None:
        """``layer``'s new K/V of ``seqs`` are in the cache (the torch path; the compiled one stores every layer
        at once, and runs only when no feature changes attention)."""

    def after_commit(self, step: Step) -> None:
        """The step's tokens are committed and its reads booked: evict, merge, summarise, book what was read."""
