"""Accounting: events that contradict the cache the earlier events built.

These are the producer's bookkeeping bugs that make every other finding unreliable: an id
allocated twice, a block freed twice, a swap from a tier the block is not in, a tier
holding more blocks than it has, a copy whose checksum did not survive a move. They are
cheap to see because the ledger already knows where every block is.
"""

from __future__ import annotations

from typing import Sequence

from ..events import (
    TIERS, Alloc, ChecksumError, Evict, Free, Release, Share, SwapIn, SwapOut, Usage,
)
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["AccountingCheck"]

_RANK = {tier: i for i, tier in enumerate(TIERS)}  # larger is slower


class AccountingCheck(CheckBase):
    name = "accounting"
    RULES = (
        Rule("double-alloc", "error", "a block id was allocated again while still allocated"),
        Rule("double-free", "error", "a block was freed or evicted again after it was already gone"),
        Rule("unknown-block", "warning", "an event names a block that is not allocated"),
        Rule("tier-mismatch", "error", "a swap or eviction names a tier the block is not in, or moves the wrong way"),
        Rule("release-not-owner", "warning", "a live sequence released a block it does not own"),
        Rule("over-capacity", "error", "a tier holds more blocks than its capacity"),
        Rule("checksum-mismatch", "error", "a block copy read back from a slower tier failed its checksum"),
    )

    def handlers(self):
        return {Alloc: self._alloc, Free: self._gone, Evict: self._gone, Share: self._share,
                Release: self._release, SwapOut: self._swap, SwapIn: self._swap, Usage: self._usage,
                ChecksumError: self._checksum}

    def _alloc(self, ev: Alloc) -> Sequence[Finding]:
        owners = self.ledger.owners.get(ev.block)
        if owners is None or self.muted("double-alloc"):
            return NO_FINDINGS
        return [self.finding(
            "double-alloc",
            f"block {ev.block} was allocated to sequence {ev.seq!r} on {ev.tier} while still allocated "
            f"on {self.ledger.tier[ev.block]} to {sorted(owners, key=str)}",
            seq=ev.seq, block=ev.block, step=ev.step, events=[self.event_dict(ev)],
            history=self.ledger.block_history(ev.block),
        )]

    def _gone(self, ev: Free | Evict) -> Sequence[Finding]:
        ledger = self.ledger
        tier = ledger.tier.get(ev.block)
        if tier is not None:
            if type(ev) is Evict and ev.tier != tier and not self.muted("tier-mismatch"):
                return [self.finding(
                    "tier-mismatch", f"block {ev.block} was evicted from {ev.tier} but sits on {tier}",
                    block=ev.block, step=ev.step, events=[self.event_dict(ev)],
                    history=ledger.block_history(ev.block),
                )]
            return NO_FINDINGS
        if ledger.freed_by(ev.block) is not None:
            if self.muted("double-free"):
                return NO_FINDINGS
            return [self.finding(
                "double-free", f"block {ev.block} was released to its pool twice (the second at step {ev.step})",
                block=ev.block, step=ev.step, events=[self.event_dict(ev)],
                history=ledger.block_history(ev.block),
            )]
        return self._unknown(ev)

    def _share(self, ev: Share) -> Sequence[Finding]:
        return NO_FINDINGS if ev.block in self.ledger.owners else self._unknown(ev)

    def _release(self, ev: Release) -> Sequence[Finding]:
        ledger = self.ledger
        owners = ledger.owners.get(ev.block)
        if owners is None:
            return self._unknown(ev)
        # seq_end already released everything the sequence owned; a release after it is fine.
        if ev.seq in owners or ev.seq not in ledger.seqs or self.muted("release-not-owner"):
            return NO_FINDINGS
        return [self.finding(
            "release-not-owner",
            f"sequence {ev.seq!r} released block {ev.block}, which is owned by {sorted(owners, key=str)}",
            seq=ev.seq, block=ev.block, step=ev.step, events=[self.event_dict(ev)],
            history=ledger.block_history(ev.block),
        )]

    def _swap(self, ev: SwapOut | SwapIn) -> Sequence[Finding]:
        ledger = self.ledger
        tier = ledger.tier.get(ev.block)
        if tier is None:
            return self._unknown(ev)
        src, dst = ev.src, ev.dst
        out_ = type(ev) is SwapOut
        wrong_way = (_RANK.get(dst, 0) <= _RANK.get(src, 0)) if out_ else (_RANK.get(dst, 0) >= _RANK.get(src, 0))
        if (tier == src and not wrong_way) or self.muted("tier-mismatch"):
            return NO_FINDINGS
        if tier != src:
            why = f"from {src}, but it sits on {tier}"
        else:
            why = f"from {src} to {dst}, which is not a {'slower' if out_ else 'faster'} tier"
        return [self.finding(
            "tier-mismatch", f"{'swap_out' if out_ else 'swap_in'} of block {ev.block} {why}",
            block=ev.block, step=ev.step, events=[self.event_dict(ev)],
            history=ledger.block_history(ev.block),
        )]

    def _usage(self, ev: Usage) -> Sequence[Finding]:
        counted = self.ledger.used.get(ev.tier, 0)
        if max(counted, ev.used_blocks) <= ev.capacity_blocks:
            return NO_FINDINGS
        if not self.once("over-capacity", ev.tier):
            return NO_FINDINGS
        return [self.finding(
            "over-capacity",
            f"tier {ev.tier} holds {max(counted, ev.used_blocks)} blocks but has room for {ev.capacity_blocks}",
            step=ev.step, tier=ev.tier, counted=counted, reported=ev.used_blocks,
            capacity=ev.capacity_blocks, events=[self.event_dict(ev)],
        )]

    def _checksum(self, ev: ChecksumError) -> Sequence[Finding]:
        if self.muted("checksum-mismatch"):
            return NO_FINDINGS
        owners = self.ledger.owners.get(ev.block) or ()
        return [self.finding(
            "checksum-mismatch",
            f"block {ev.block} read back from {ev.tier} has checksum {ev.actual:#x}, expected {ev.expected:#x}",
            seq=sorted(owners, key=str)[0] if owners else None, block=ev.block, step=ev.step,
            events=[self.event_dict(ev)], history=self.ledger.block_history(ev.block),
        )]

    def _unknown(self, ev) -> Sequence[Finding]:
        if not self.once("unknown-block", ev.block):
            return NO_FINDINGS
        return [self.finding(
            "unknown-block", f"{_kind(ev)} names block {ev.block}, which is not allocated"
            + ("" if not self.ledger.num_freed_forgotten else f" ({self.ledger.never_allocated()})"),
            seq=getattr(ev, "seq", None), block=ev.block, step=ev.step, events=[self.event_dict(ev)],
        )]


def _kind(ev) -> str:
    return type(ev).__struct_config__.tag
