"""``ReadPlan``: for one step, where every block attention reads comes from, built once before the forward pass.

With long context (``EngineConfig.staging_blocks``) a running sequence's blocks may sit in any tier. The
cache describes each row's blocks as plain data (``BlockLoc``: which block, where it is, which version
that copy holds) and ``plan_reads`` splits them into the blocks read in place on the device and the
ones that go through the bounded device staging area, in chunks no larger than the area. Attention
(``engine.features.streaming``) only consumes the plan; it never asks the cache where a block is, so the data
path stays one way: scheduler -> cache (plan) -> attention -> events (vLLM's per-step attention
metadata is the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["BlockLoc", "RowPlan", "ReadPlan", "plan_reads"]


@dataclass(frozen=True, slots=True)
class BlockLoc:
    """One block of a row as the step finds it."""

    pos: int  # its place in the row's block table (the key positions pos*block_size ...), what top-k selects by
    index: int  # the block's position in its sequence: tokens index*block_size ... index*block_size + block_size - 1
    block: int  # block id
    tier: str
    slot: int  # tier slot (which arena and where in it)
    version: int  # version of the copy in that slot
    codec: str


@dataclass(frozen=True)
class RowPlan:
    """One row: its keys, its queries, and its blocks split by where they are read from."""

    seq: Any
    kv_len: int  # keys after this step's tokens are stored
    q_len: int  # this step's new tokens (the queries): positions kv_len - q_len ... kv_len - 1
    resident: tuple[BlockLoc, ...]  # on the device: read in place
    streamed: tuple[BlockLoc, ...]  # on a slower tier: read through the staging area
    chunks: tuple[tuple[BlockLoc, ...], ...]  # ``streamed`` in pieces that each fit the staging area

    @property
    def num_blocks(self) -> int:
        return len(self.resident) + len(self.streamed)


@dataclass(frozen=True)
class ReadPlan:
    rows: tuple[RowPlan, ...]
    staging_blocks: int

    @property
    def streaming(self) -> bool:
        """Some row reads a block that is not on the device: attention must stream it."""
        return any(r.streamed for r in self.rows)


def plan_reads(rows: Sequence[tuple[Any, int, int, Sequence[BlockLoc]]], staging_blocks: int) -> ReadPlan:
    """The plan for rows ``(seq, kv_len, q_len, blocks in position order)``: device blocks read in place, the rest
    in chunks of at most ``staging_blocks`` (in position order, so a chunk is a run of neighbouring blocks
    where the tier allows and a disk read is one sequential piece)."""
    if staging_blocks < 1 and any(b.tier != "device" for _, _, _, blocks in rows for b in blocks):
        raise ValueError("a block off the device needs a staging area (staging_blocks >= 1)")
    out = []
    for seq, kv_len, q_len, blocks in rows:
        if not 1 <= q_len <= kv_len:
            raise ValueError(f"row {seq!r}: needs 1 <= q_len ({q_len}) <= kv_len ({kv_len})")
        resident = tuple(b for b in blocks if b.tier == "device")
        streamed = tuple(b for b in blocks if b.tier != "device")
        chunks = tuple(streamed[i : i + staging_blocks] for i in range(0, len(streamed), max(staging_blocks, 1)))
        out.append(RowPlan(seq, kv_len, q_len, resident, streamed, chunks))
    return ReadPlan(tuple(out), staging_blocks)
