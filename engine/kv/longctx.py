"""Long context's booking in the cache: which blocks a step holds on the device, each step's read plan,
and after a streamed step the events and counters of what attention read from where.

A running sequence keeps only its sinks, its recent window and the block being appended to on the
device; the rest may be demoted, and attention streams them through the staging area
(``engine.kv.staging``, ``engine.features.streaming``). Without long context this part only hands the read plan
over to the resident reads (``engine.kv.readplan``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ...events import PrefetchUse, Stage
from ..config import Tier
from .pool import Block
from .readplan import BlockLoc, ReadPlan, plan_reads
from .sequences import SeqState

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["LongContextBook"]


class LongContextBook:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.bytes_staged = 0  # bytes the staging area moved, every step so far
        self.rows_from_device = 0  # (layer, block) reads served by a copy already on the device
        self.rows_from_slower = 0  # ... and those that had to be copied up from a slower tier

    def hold(self, s: SeqState, tail: Block | None) -> set[int]:
        """Keep ``s``'s sinks, recent window and the block being appended to on the device this step."""
        c, held = self.cache.config, self.cache.step.held
        mine = {b.id for b in s.blocks[: c.sink_blocks]} | {b.id for b in s.blocks[-c.local_blocks :]}
        if tail is not None:
            mine.add(tail.id)
        held |= mine
        return set(held)

    def max_step_tokens(self, seq: Any) -> int | None:
        """The most new tokens ``seq`` may reserve in one step (a prompt longer than the device is prefilled in
        chunks this size): the blocks they touch, its sinks and its window fit the device. None: no limit."""
        cache = self.cache
        if cache.staging is None:
            return None
        s = cache.seqs.get(seq)
        start = s.length + s.pending if s is not None else 0
        room = cache.pool.slots[Tier.DEVICE].capacity - cache.config.pinned_blocks
        return max(room * cache.block_size - start % cache.block_size, 1)

    def plan_reads(self, seqs: Sequence[Any], q_lens: Sequence[int]) -> ReadPlan:
        """This step's ``ReadPlan``, built once before the forward pass: where each row's blocks are read from.

        Without long context (or when every block is on the device) the blocks are made resident, as always,
        and the plan reads them in place; with it, prefetches in flight land first, and each block is read where
        it is."""
        cache = self.cache
        if cache.staging is None:
            cache.ensure_resident(seqs)
            return cache.reads.read_plan(seqs)
        rows = []
        step = cache.step
        step.tick += 1
        for seq, q in zip(seqs, q_lens):
            s = cache.seqs.require(seq)
            step.pinned.add(seq)
            s.last_access = step.tick
            locs = []
            for pos, b in enumerate(s.blocks):
                cache.mover.try_settle(b)  # a bad copy was dropped: the block is read where it was
                locs.append(BlockLoc(pos, b.index, b.id, b.tier, b.slot, b.version, b.codec))
            rows.append((seq, cache.seqs.num_tokens(seq), q, locs))
        plan = plan_reads(rows, cache.config.staging_blocks, cache.reads)
        if not plan.streaming:  # all on the device: the resident path reads them (prefetch hits counted there)
            cache.ensure_resident(seqs)
            return cache.reads.read_plan(seqs)
        return plan

    def book_streamed(self, reads: dict[Any, dict[int, tuple[str, int, int]]], device_rows: int, staged_rows: int,
                      *, predict: bool) -> None:
        """After a streamed step's commit: the ``stage``, ``prefetch_use`` and ``read`` events of what attention
        read, and (``predict``: block-sparse top-k) a background prefetch of the blocks it read from slower tiers,
        which the next step's query will likely choose again, into device room the placement policy makes."""
        cache = self.cache
        bus, mover, blocks = cache.bus, cache.mover, cache.pool.blocks
        staged = cache.staging.end_step()
        self.bytes_staged += staged.bytes_moved
        self.rows_from_device += device_rows + staged.rows_reused
        self.rows_from_slower += staged.rows_staged
        predicted: list[Block] = []
        for seq, got in reads.items():
            if cache.seqs.get(seq) is None:
                continue
            hits, misses = [], []
            for bid, (tier, _, pos) in got.items():
                b = blocks.get(bid)
                if b is None:
                    continue
                b.last_access = cache.step.tick
                if tier == Tier.DEVICE and mover.take_prefetched(b):
                    hits.append(bid)
                elif tier != Tier.DEVICE:
                    misses.append(bid)
                    predicted.append(b)
            if predict:
                mover.prefetch_hits += len(hits)
                mover.prefetch_misses += len(misses)
            if not bus.enabled:
                continue
            copies = staged.copies.get(seq, {})
            if copies:
                bus.emit(Stage, seq=seq, blocks=list(copies), srcs=[t for t, _ in copies.values()],
                         versions=[v for _, v in copies.values()], bytes=staged.bytes_by_seq.get(seq, 0))
            if predict and (hits or misses):
                bus.emit(PrefetchUse, seq=seq, hits=hits, misses=misses)
            order = sorted(got.items(), key=lambda kv: kv[1][2])
            # a resident copy was read after this step's write into it: it holds the committed version
            versions = [blocks[bid].version if t == Tier.DEVICE and bid in blocks else v
                        for bid, (t, v, _) in order]
            cache.emit_read(seq, [bid for bid, _ in order], versions=versions, tiers=[t for _, (t, _, _) in order])
        if predict and predicted and cache.config.prefetch_depth:
            # room comes from the blocks the policy ranks lowest (a block read this step has just been touched)
            mover.prefetch(predicted[: cache.config.prefetch_depth], Tier.DEVICE, exclude=set(cache.step.held))
