"""Stale data: attention reading, or a swap bringing back, an older copy than the last write.

Versions make staleness visible without looking at a single tensor: every write stamps
the block with the sequence's new version, every move of the block carries the version of
the copy moved, and every read says which version it saw. A copy older than the block's
last write is stale (a swap-in that served an outdated host copy, a write that never
reached the tier that was read). A read of a block that was freed or evicted reads
whatever the next owner put there.
"""

from __future__ import annotations

from typing import Sequence

from ..events import Evict, Read, Rollback, SwapIn, SwapOut, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["StaleCheck"]


class StaleCheck(CheckBase):
    name = "stale"
    RULES = (
        Rule("stale-read", "error", "a read saw an older version of a block than the last write into it"),
        Rule("stale-swap-in", "error", "a swap-in brought back an older copy than the block's last write"),
        Rule("stale-swap-out", "error", "a swap-out moved an older copy than the block's last write"),
        Rule("read-freed", "error", "a read of a block that was freed or evicted (or never allocated)"),
        Rule("version-not-advanced", "error",
             "a write of n tokens did not advance its sequence's version by exactly n"),
        Rule("rollback-version", "error", "a rollback did not advance its sequence's version"),
        Rule("rollback-count", "error",
             "a rollback of fewer than 1 or more tokens than its sequence holds (a crop past what was written)"),
    )

    def handlers(self):
        return {Read: self._read, SwapIn: self._swap, SwapOut: self._swap, Write: self._write,
                Rollback: self._rollback}

    def _read(self, ev: Read) -> Sequence[Finding]:
        version = self.ledger.version
        # Fast path in C: every block still written at exactly the version the read saw.
        try:
            if list(map(version.__getitem__, ev.blocks)) == ev.versions:
                return NO_FINDINGS
        except KeyError:
            pass
        out = []
        owners = self.ledger.owners
        for block, seen in zip(ev.blocks, ev.versions):
            if block not in owners:
                out.extend(self._read_freed(ev, block))
                continue
            last = version.get(block)
            if last is not None and seen < last:
                out.extend(self._stale("stale-read", ev, block, seen, last, seq=ev.seq))
        return out

    def _swap(self, ev: SwapIn | SwapOut) -> Sequence[Finding]:
        last = self.ledger.version.get(ev.block)
        if last is None or ev.version >= last:
            return NO_FINDINGS
        rule = "stale-swap-in" if type(ev) is SwapIn else "stale-swap-out"
        return self._stale(rule, ev, ev.block, ev.version, last, seq=self.ledger.owner(ev.block))

    def _stale(self, rule: str, ev, block: int, seen: int, last: int, *, seq) -> Sequence[Finding]:
        if not self.once(rule, block, last):
            return NO_FINDINGS
        if rule == "stale-read":
            what = f"sequence {ev.seq!r} read"
        else:
            what = f"{'swap-in' if rule == 'stale-swap-in' else 'swap-out'} {ev.src}->{ev.dst} moved"
        return [self.finding(
            rule,
            f"{what} version {seen} of block {block}, but the last write into it made version {last}",
            seq=seq, block=block, layer=getattr(ev, "layer", None), step=ev.step,
            seen_version=seen, last_write_version=last, tier=self.ledger.tier.get(block),
            events=[self.event_dict(ev)], history=self.ledger.block_history(block),
        )]

    def _read_freed(self, ev: Read, block: int) -> Sequence[Finding]:
        if not self.once("read-freed", block, ev.seq):
            return NO_FINDINGS
        gone = self.ledger.freed_by(block)
        if gone is None:
            why = f"which was {self.ledger.never_allocated()}"
        else:
            why = f"which was {'evicted' if type(gone) is Evict else 'freed'} at step {gone.step}"
        return [self.finding(
            "read-freed", f"sequence {ev.seq!r} read block {block}, {why}",
            seq=ev.seq, block=block, layer=ev.layer, step=ev.step,
            events=[self.event_dict(ev)], history=self.ledger.block_history(block),
        )]

    def _write(self, ev: Write) -> Sequence[Finding]:
        state = self.ledger.seqs.get(ev.seq)
        if state is None or state.version is None or ev.version == state.version + ev.n:
            return NO_FINDINGS
        if not self.once("version-not-advanced", ev.seq):
            return NO_FINDINGS
        return [self.finding(
            "version-not-advanced",
            f"write of {ev.n} tokens into block {ev.block} by sequence {ev.seq!r} set its version to "
            f"{ev.version}; from {state.version} it must become {state.version + ev.n}",
            seq=ev.seq, block=ev.block, step=ev.step, previous_version=state.version,
            expected_version=state.version + ev.n, events=[self.event_dict(ev)],
            history=self.ledger.block_history(ev.block),
        )]

    def _rollback(self, ev: Rollback) -> Sequence[Finding]:
        state = self.ledger.seqs.get(ev.seq)
        if (state is not None and state.length is not None and not 1 <= ev.n <= state.length
                and self.once("rollback-count", ev.seq)):
            return [self.finding(
                "rollback-count",
                f"rollback of {ev.n} tokens of sequence {ev.seq!r}, which holds {state.length}: "
                f"{'a crop to a longer length than was written' if ev.n < 1 else 'more than was written'}",
                seq=ev.seq, step=ev.step, position=state.length - ev.n, length=state.length,
                events=[self.event_dict(ev)],
            )]
        if state is None or state.version is None or ev.version > state.version:
            return NO_FINDINGS
        if not self.once("rollback-version", ev.seq, ev.version):
            return NO_FINDINGS
        return [self.finding(
            "rollback-version",
            f"rollback of {ev.n} tokens of sequence {ev.seq!r} left its version at {ev.version}; "
            f"it must exceed {state.version} so that copies from before the rollback look stale",
            seq=ev.seq, step=ev.step, previous_version=state.version, events=[self.event_dict(ev)],
        )]
