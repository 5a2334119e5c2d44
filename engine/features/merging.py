"""Token merging as a step feature: which blocks merge and when (``TokenMerging``). How rows merge, what a block
keeps and the score bias that makes a merged slot count as the tokens it replaced (``key_bias``, which a step's
read plan carries to attention) are the KV core's: ``engine.kv.merge``."""

from __future__ import annotations

from typing import Any, Sequence

from .protocol import Step, StepFeature

__all__ = ["TokenMerging"]


class TokenMerging(StepFeature):
    """Merges each sequence's old, full blocks (``PagedKVCache.merge_tokens``) after the step's commit
    (``after_commit``). Keeps the figures a benchmark reports."""

    changes_attention = True  # a merged slot's score gets its log(count)

    def __init__(self, cache: Any, *, threshold: float, sink_blocks: int, local_blocks: int) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"merge threshold {threshold!r}: must be in (0, 1]")
        self.cache, self.threshold = cache, threshold
        self.sink_blocks, self.local_blocks = sink_blocks, local_blocks
        self.blocks_merged = 0  # blocks that shrank
        self.rows_freed = 0  # (layer, head, slot) rows they gave up

    @classmethod
    def for_cache(cls, cache: Any) -> TokenMerging | None:
        c = cache.config
        if not c.merge:
            return None
        return cls(cache, threshold=c.merge, sink_blocks=c.sink_blocks, local_blocks=c.local_blocks)

    def candidates(self, seq: Any) -> list[int]:
        """Blocks of ``seq`` to look at now: past its sinks, wholly older than its recent window (its newest
        ``local_blocks * block_size`` tokens, so a rollback of that many never reaches a merged block), not
        looked at yet, owned by ``seq`` alone, settled on the device."""
        if not self.cache.has_sequence(seq):
            return []
        s = self.cache.sequence(seq)
        bs = self.cache.block_size
        end = s.length - self.local_blocks * bs
        looked = self.cache.slot_counts(seq)
        return [b.id for b, m in zip(s.blocks, looked) if m is None and b.index >= self.sink_blocks
                and (b.index + 1) * bs <= end and b.owners == [seq] and b.tier == "device" and b.inflight is None]

    def enforce(self, seqs: Sequence[Any]) -> list[int]:
        """Merge what each of ``seqs`` has aged; returns the blocks that shrank."""
        out: list[int] = []
        for seq in seqs:
            todo = self.candidates(seq)
            if todo:
                freed = self.cache.merge_tokens(todo, self.threshold)
                out.extend(freed)
                self.rows_freed += sum(freed.values())
        self.blocks_merged += len(out)
        return out

    def after_commit(self, step: Step) -> None:
        """Blocks that aged out of the recent window this step."""
        self.enforce(step.seqs)

    def stats(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "blocks_merged": self.blocks_merged, "rows_freed": self.rows_freed}

    def live_rows(self, seq: Any) -> tuple[int, int]:
        """``seq``'s live (layer, head, slot) rows and the rows its blocks have (committed tokens only)."""
        s = self.cache.sequence(seq)
        c, bs = self.cache.config, self.cache.block_size
        per_token = c.num_layers * c.num_kv_heads
        total = live = 0
        for b, m in zip(s.blocks, self.cache.slot_counts(seq)):
            rows = min(bs, max(s.length - b.index * bs, 0)) * per_token
            total += rows
            live += m.live if m is not None and m.counts is not None else rows
        return live, total
