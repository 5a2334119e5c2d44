"""Which step features a runner's steps run with: what the cache's config and the model ask for, in the order
every point of a step calls them, with the combinations that cannot run together refused when the runner is made.

A new feature joins here (and implements ``engine.features.protocol``), never in the runner.
"""

from __future__ import annotations

from typing import Any

from .importance import ImportanceEviction
from .merging import TokenMerging
from .protocol import StepFeature
from .sparse import BlockSparse
from .streaming import StreamedAttention
from .window import SlidingWindow

__all__ = ["step_features"]


def step_features(cache: Any, model_config: Any) -> list[StepFeature]:
    """The active features of a runner over ``cache`` for a model of ``model_config``, in their order (after a
    commit: merge, book the streamed reads, summarise, evict)."""
    sparse = BlockSparse.for_cache(cache)  # block-sparse top-k reads (or H2O's attention mass)
    importance = ImportanceEviction.for_cache(cache)
    window = SlidingWindow.of_model(model_config)
    merging = TokenMerging.for_cache(cache)
    # Long context: a step whose rows have blocks off the device attends through the staging area.
    streamer = StreamedAttention(cache, cache.staging, sparse) if cache.staging is not None else None
    if merging is not None and window is not None:
        raise ValueError("token merging is not supported with sliding-window attention (a merged block's "
                         "slots are not its token positions)")
    if window is not None and sparse is not None:
        raise ValueError("block-sparse top-k reads are not supported with sliding-window attention")
    if streamer is not None and (window is not None or importance is not None):
        raise ValueError("long context (staging_blocks) is not supported with sliding-window attention "
                         "or importance eviction")
    return [f for f in (merging, streamer, sparse, importance, window) if f is not None]
