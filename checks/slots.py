"""Slots: K/V read where nothing was written, and caches whose length disagrees with what a cut left.

Attention reads every slot its mask lets through. A slot no write produced holds whatever the memory held:
zeros of a reset that only zeroed (transformers #48509), tokens a crop kept (transformers #47433), a fresh
block's leftovers or NaN that 0 x NaN spreads through the softmax (vllm PR #43990, flash-attention #1745).
Nothing crashes; the model attends to garbage. Three rules:
- ``unwritten-read``: a ``read`` with a ``span`` of positions, some of which no ``write`` into the listed
  blocks produced since they were allocated (named: the sequence, the block, the positions, the layer, the step);
- ``cut-length``: a ``truncate`` after which the cache reports another length than the cut asked to leave,
  so the next pass appends after stale slots;
- ``padding-nonfinite``: a ``padding`` event saying a pass wrote non-finite K/V into a row's padding slots
  (transformers #46765, flash-attention #1745: a half-precision overflow at pad tokens). Attention masks
  those slots, but 0 x NaN in its weighted sum turns the row's output NaN a layer later: this names the row,
  the slots, the layer and the step where the NaN was written, not where it surfaced;
- ``nonfinite-write``: a ``write`` saying it stored NaN or Inf into real slots (its ``nonfinite`` positions,
  vllm PR #43990's NaN K/V read as real, transformers #46765's padding NaN reaching real rows). Every later
  read of the block attends to them. Judged at the step's end: when, that step, the sequence's attention
  went non-finite at a layer below the write's first, or it read a block holding non-finite K/V below it
  (a NaN value weighs the output NaN with finite scores), the NaN came up through the hidden state from
  where an earlier finding names it; otherwise the write is where it began (sequence, block, positions,
  first layer, step, and the writer's frames).
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from ..events import Alloc, Attn, AttnStep, Evict, Free, Padding, Read, Snapshot, Truncate, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["SlotsCheck"]

_REPORTS = {"reset": "transformers #48509: a reset that zeroes in place keeps the old length",
            "crop": "transformers #47433: crop(0) or an oversized negative crop keeps tokens"}


def _ranges(positions: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    out, start = [], positions[0]
    for prev, p in zip(positions, positions[1:] + [None]):
        if p != prev + 1:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = p
    return ", ".join(out)


class SlotsCheck(CheckBase):
    name = "slots"
    RULES = (
        Rule("unwritten-read", "error",
             "a read covered positions that no write into its blocks produced since they were allocated"),
        Rule("cut-length", "error",
             "after a crop or reset the cache reports another length than the cut asked to leave"),
        Rule("padding-nonfinite", "error",
             "a pass wrote non-finite K/V into a row's padding slots, which attention masks but multiplies by 0"),
        Rule("nonfinite-write", "error", "a write stored NaN or Inf K/V into real slots, which later reads attend to"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self.written: dict[int, list[tuple[int, int]]] = {}  # block -> (pos, n) of each write since allocation
        self._nan_blocks: dict[int, int] = {}  # block -> the lowest layer of the non-finite K/V written into it
        self._nan_writes: dict = {}  # seq -> its first write this step that stored non-finite K/V
        # seq -> the lowest layer where, this step, its attention went non-finite or a block it read holds NaN/Inf
        self._nan_below: dict = {}

    def handlers(self):
        return {Alloc: self._gone, Free: self._gone, Evict: self._gone, Write: self._write, Read: self._read,
                Truncate: self._truncate, Snapshot: self._snapshot, Padding: self._padding, Attn: self._attn,
                AttnStep: self._attn_step}

    def _gone(self, ev: Alloc | Free | Evict) -> Sequence[Finding]:
        self.written.pop(ev.block, None)
        if self._nan_blocks:
            self._nan_blocks.pop(ev.block, None)
        return NO_FINDINGS

    def _write(self, ev: Write) -> Sequence[Finding]:
        self.written.setdefault(ev.block, []).append((ev.pos, ev.n))
        if ev.nonfinite:
            self._nan_writes.setdefault(ev.seq, ev)
            layer = ev.nonfinite_layer if ev.nonfinite_layer is not None else 0
            self._nan_blocks[ev.block] = min(layer, self._nan_blocks.get(ev.block, layer))
        return NO_FINDINGS

    def _below(self, seq, layer: int) -> None:
        """``seq`` met non-finite K/V or attention at ``layer`` this step."""
        if layer < self._nan_below.get(seq, layer + 1):
            self._nan_below[seq] = layer

    def _attn(self, ev: Attn) -> Sequence[Finding]:
        if ev.nonfinite:
            self._below(ev.seq, ev.layer)
        return NO_FINDINGS

    def _attn_step(self, ev: AttnStep) -> Sequence[Finding]:
        for layer, counts in enumerate(ev.nonfinite):
            if any(counts):  # a clean step: one pass over the counts per layer
                for seq, n in zip(ev.seqs, counts):
                    if n:
                        self._below(seq, layer)
        return NO_FINDINGS

    def end_step(self, step: int) -> Sequence[Finding]:
        if not self._nan_writes:
            self._nan_below.clear()
            return NO_FINDINGS
        out = []
        for seq, ev in self._nan_writes.items():
            below = self._nan_below.get(seq)
            layer = ev.nonfinite_layer
            if (below is not None and layer is not None and below < layer) or not self.once("nonfinite-write", seq):
                continue  # the NaN came up from a layer below: attention/nonfinite names where it began
            where = f", first at layer {layer}" if layer is not None else ""
            f = self.finding(
                "nonfinite-write",
                f"sequence {seq!r} wrote non-finite K/V (NaN or Inf) into block {ev.block} at position(s) "
                f"{_ranges(sorted(ev.nonfinite))}{where} at step {ev.step}: every later read of the block attends "
                f"to them, and a NaN key or value turns the scores or the output NaN (vllm PR #43990, "
                f"transformers #46765)",
                seq=seq, block=ev.block, layer=layer, step=ev.step, positions=list(ev.nonfinite)[:64],
                events=[self.event_dict(ev)], history=self.ledger.block_history(ev.block))
            if ev.stack:  # the writer first: the finding's location is the user's line that ran the write
                f = msgspec.structs.replace(f, stacks={"write": ev.stack, **self.ledger.stacks(ev.block, seq)})
            out.append(f)
        self._nan_writes.clear()
        self._nan_below.clear()
        return out

    def _snapshot(self, ev: Snapshot) -> Sequence[Finding]:
        for b in ev.blocks:  # attached mid-run: what each block's writes so far left in it
            if b.n:
                self.written[b.block] = [(b.pos, b.n)]
        return NO_FINDINGS

    def _read(self, ev: Read) -> Sequence[Finding]:
        if self._nan_blocks:
            held = [self._nan_blocks[b] for b in ev.blocks if b in self._nan_blocks]
            if held:
                self._below(ev.seq, min(held))
        if ev.span is None:
            return NO_FINDINGS
        start, end = ev.span
        covered = sorted(w for b in ev.blocks for w in self.written.get(b, ()))
        missing, at = [], start
        for pos, n in covered:  # walk the writes in order; gaps before each are unwritten
            if pos > at:
                missing.extend(range(at, min(pos, end)))
            at = max(at, pos + n)
            if at >= end:
                break
        missing.extend(range(at, end))
        if not missing:
            return NO_FINDINGS
        block = self._block_of(ev.blocks, missing[0])
        if not self.once("unwritten-read", ev.seq, block):
            return NO_FINDINGS
        return [self.finding(
            "unwritten-read",
            f"sequence {ev.seq!r} read positions {_ranges(missing)} of block {block} at step {ev.step}"
            f"{'' if ev.layer is None else f', layer {ev.layer}'}, but no write produced them since the block was "
            f"allocated: attention took stale or uninitialised K/V (zeros, another request's leftovers, NaN)",
            seq=ev.seq, block=block, step=ev.step, layer=ev.layer, positions=missing[:64], span=list(ev.span),
            events=[self.event_dict(ev)], history=self.ledger.block_history(block),
        )]

    def _block_of(self, blocks: list[int], pos: int) -> int:
        """The read block ``pos`` falls in: one never written, else the last one whose writes start at or before it."""
        never = [b for b in blocks if not self.written.get(b)]
        if never:
            return never[0]
        starts = [(min(p for p, _ in self.written[b]), b) for b in blocks]
        before = [b for s, b in starts if s <= pos]
        return before[-1] if before else blocks[0]

    def _truncate(self, ev: Truncate) -> Sequence[Finding]:
        if ev.length == ev.keep or not self.once("cut-length", ev.cache, ev.step):
            return NO_FINDINGS
        where = f" at layer {ev.layer}" if ev.layer is not None else ""
        extra = ev.length - ev.keep
        effect = (f"the next pass appends after {extra} stale slot(s) and attends to them" if extra > 0 else
                  f"{-extra} slot(s) the rows still count are gone")
        return [self.finding(
            "cut-length",
            f"{ev.asked or ev.op} on cache {ev.cache or '?'} at step {ev.step} should leave {ev.keep} slots per row, "
            f"but the cache reports {ev.length}{where}: {effect} ({_REPORTS.get(ev.op, ev.op)})",
            step=ev.step, layer=ev.layer, keep=ev.keep, length=ev.length, cache=ev.cache,
            events=[self.event_dict(ev)],
        )]

    def _padding(self, ev: Padding) -> Sequence[Finding]:
        if not ev.nonfinite or not self.once("padding-nonfinite", ev.seq):
            return NO_FINDINGS
        where = f" at layer {ev.layer}" if ev.layer is not None else ""
        return [self.finding(
            "padding-nonfinite",
            f"sequence {ev.seq!r}'s row got {ev.nonfinite} non-finite K/V value(s) written into its padding slots "
            f"{_ranges(sorted(ev.slots)) if ev.slots else '(unnamed)'}{where} at step {ev.step}: attention masks padding, but 0 x NaN in its "
            f"weighted sum makes the row's output NaN (transformers #46765: a half-precision overflow at pad tokens)",
            seq=ev.seq, step=ev.step, layer=ev.layer, slots=list(ev.slots)[:64], nonfinite=ev.nonfinite,
            cache=ev.cache, events=[self.event_dict(ev)],
        )]
