"""The step-feature protocol: how a KV feature joins the runner's steps without the runner naming it.

A step feature (block-sparse reads, importance eviction, sliding windows, token merging, long-context
streaming, and whatever comes next) is told when a step begins, after each layer's new K/V are stored,
and after the step's tokens are committed; and it says whether it changes what attention computes this
step. One that does may take attention over: for the whole step at a layer (``attend_step``: long context
reads every row through staging), for one group of rows (``attend``: block-sparse reads), or only give the
mask a layer attends with (``layout``: sliding windows); and it may say which blocks a row really read
(``read_ids``). What attention saw comes back through the ``Step``: each block's attention mass per layer for
a feature that ranks blocks by it (H2O), and the newest queries' mass and scores from a feature that attended
for the whole step, which the runner books as it books its own.

The runner holds the active features in one list (``engine.features.registry``), calls them in its order at
each of these points, asks a hook only of the features whose class defines it (``implementing``), and runs a
decode step's compiled layers (``engine.model.decode_layer``) exactly when none changes attention: nothing
keeps a list of which features do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...events import SeqId
from ..model.attention import AttnLayout, Group, Newest

__all__ = ["Group", "Step", "StepFeature", "implementing"]


@dataclass(frozen=True)
class Step:
    """What a feature may need to know of the step being computed, and what attention saw in it."""

    seqs: Sequence[SeqId]  # the step's rows, in order
    cache: Any = None  # the ``PagedKVCache`` the step reads and writes
    plan: Any = None  # the cache's ``ReadPlan``: where every row's blocks are read from; a feature reads through it
    want_mass: bool = False  # the placement policy ranks blocks by the attention they get this step
    want_scores: bool = False  # attention statistics are taken this step
    starts: Sequence[int] = ()  # where each row's tokens start among the step's tokens
    # (seq, the row's block ids, the mass each got) per layer and row, summed over heads and queries, for the features
    # that rank blocks by it (``wants_block_mass``); None when none does
    block_mass: list[tuple[SeqId, list[int], torch.Tensor]] | None = None
    # from a feature that attended for the whole step (``attend_step``), per row: its newest query's mass on each
    # block, the mean over layers (the placement policy's, when ``want_mass``), and its scores (H, T) at every
    # layer (the statistics, when ``want_scores``)
    newest_mass: dict[SeqId, torch.Tensor] = field(default_factory=dict)
    newest_scores: dict[SeqId, list[torch.Tensor]] = field(default_factory=dict)


class StepFeature:
    """A feature of the runner's steps: the protocol, each point a no-op until a feature overrides it.

    ``changes_attention`` is read after ``begin_step``: a feature may change attention on some steps only
    (long context, on the steps that stream). ``wants_block_mass``: the feature ranks blocks by the attention
    mass each gets (``Step.block_mass``), so the feature that attends computes it."""

    changes_attention: bool = False  # attention computes something other than dense attention over the rows' blocks
    wants_block_mass: bool = False

    def begin_step(self, step: Step) -> None:
        """Before the first layer: the step's rows, their blocks and what is wanted of attention are known."""

    def after_store(self, layer: int, seqs: Sequence[SeqId]) -> None:
        """``layer``'s new K/V of ``seqs`` are in the cache (the torch path; the compiled one stores every layer
        at once, and runs only when no feature changes attention)."""

    def attend_step(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Attention output (N, H*D) of every row's queries ``q`` (N, H, D) at ``layer``, in the runner's place;
        None: not this step."""
        return None

    def attend(self, layer: int, q: torch.Tensor, group: Group, scale: float) -> tuple[torch.Tensor, Newest | None] | None:
        """Attention of ``group``'s queries ``q`` (B, H, S, D) at ``layer`` in the runner's place: the output
        (B, H, S, D) and, when ``Step.want_scores``, the newest query's scores over every key position; None: the
        runner's own attention."""
        return None

    def layout(self, layer: int, group: Group) -> AttnLayout | None:
        """The mask ``group`` attends with at ``layer`` when it is not the group's own (``Group.layout``)."""
        return None

    def read_ids(self, seq: SeqId, ids: Sequence[int]) -> list[int] | None:
        """Which of ``ids`` (the row's block ids, in position order) this step's attention read; None: all."""
        return None

    def after_commit(self, step: Step) -> None:
        """The step's tokens are committed and its reads booked: evict, merge, summarise, book what was read."""


def implementing(features: Sequence[StepFeature], hook: str) -> list[StepFeature]:
    """The features whose class defines ``hook``, in order: the runner asks only them, so a hook no active
    feature has costs a step nothing."""
    base = getattr(StepFeature, hook)
    return [f for f in features if getattr(type(f), hook) is not base]
