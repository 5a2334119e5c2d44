"""Prefix-cache hits on the wrong content: the bug that leaves every reference count right.

A prefix cache hands one request blocks another request computed, found by a key derived
from the tokens. When the key is wrong (it leaves out a parent block, a salt, a token) or a
block is rewritten while the cache still maps a key to it, the hit is served foreign K/V and
no owner, version or count looks wrong. ``share`` events that carry ``hash`` make it visible:
the first share of a block with a hash registers the block's content key, every later one is
a hit that must carry the same key, and a write into a registered block in a later step than
its registration means the key no longer describes what the block holds (an engine may
register a block while scheduling the step that fills it, as vLLM does).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..events import PREFIX_CACHE, Evict, Free, Release, Share, Snapshot, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["PrefixCheck"]


class _Registration:
    """A block's content key and who registered it; ``rewrite`` is the first write after that."""

    __slots__ = ("key", "seq", "step", "rewrite")

    def __init__(self, key: str, seq: Any, step: int) -> None:
        self.key, self.seq, self.step = key, seq, step
        self.rewrite: Write | None = None


class PrefixCheck(CheckBase):
    name = "prefix"
    RULES = (
        Rule("hash-mismatch", "error",
             "a prefix-cache hit took a block registered under another content key than the hitting sequence's"),
        Rule("rewritten-hit", "error",
             "a prefix-cache hit took a block that was written again in a step after it was registered"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self._reg: dict[int, _Registration] = {}

    def handlers(self):
        return {Share: self._share, Write: self._write, Release: self._release, Free: self._gone, Evict: self._gone,
                Snapshot: self._snapshot}

    def _share(self, ev: Share) -> Sequence[Finding]:
        if ev.hash is None:
            return NO_FINDINGS
        reg = self._reg.get(ev.block)
        if reg is None:
            self._reg[ev.block] = _Registration(ev.hash, ev.seq, ev.step)
            return NO_FINDINGS
        if reg.key != ev.hash and self.once("hash-mismatch", ev.block, ev.seq):
            return [self.finding(
                "hash-mismatch",
                f"sequence {ev.seq!r} hit block {ev.block} under content key {ev.hash}, but {reg.seq!r} registered "
                f"it under {reg.key} at step {reg.step}: it holds other tokens than this sequence's prefix",
                seq=ev.seq, block=ev.block, step=ev.step, key=ev.hash, registered_key=reg.key,
                registered_by=reg.seq, events=[self.event_dict(ev)], history=self.ledger.block_history(ev.block),
            )]
        if reg.rewrite is not None and self.once("rewritten-hit", ev.block, ev.seq):
            w = reg.rewrite
            return [self.finding(
                "rewritten-hit",
                f"sequence {ev.seq!r} hit block {ev.block} (registered by {reg.seq!r} at step {reg.step}), but "
                f"{w.seq!r} wrote positions {w.pos}..{w.pos + w.n - 1} into it at step {w.step} after that",
                seq=ev.seq, block=ev.block, step=ev.step, key=ev.hash, rewritten_by=w.seq,
                events=[self.event_dict(ev), self.event_dict(w)], history=self.ledger.block_history(ev.block),
            )]
        return NO_FINDINGS

    def _snapshot(self, ev: Snapshot) -> Sequence[Finding]:
        for b in ev.blocks:  # attached mid-run: the blocks the cache had registered, under their keys
            if b.hash is not None:
                self._reg[b.block] = _Registration(b.hash, PREFIX_CACHE, ev.step)
        return NO_FINDINGS

    def _write(self, ev: Write) -> Sequence[Finding]:
        reg = self._reg.get(ev.block)
        if reg is not None and reg.rewrite is None and ev.step > reg.step:
            reg.rewrite = ev
        return NO_FINDINGS

    def _release(self, ev: Release) -> Sequence[Finding]:
        reg = self._reg.get(ev.block)
        if reg is not None and reg.seq == ev.seq:  # the cache let the block go: its key no longer names it
            del self._reg[ev.block]
        return NO_FINDINGS

    def _gone(self, ev: Free | Evict) -> Sequence[Finding]:
        self._reg.pop(ev.block, None)
        return NO_FINDINGS
