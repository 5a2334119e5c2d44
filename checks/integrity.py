"""Integrity: the bytes a block holds are the bytes the last write put there.

Versions (``stale``) prove that the right *copy* was read; they cannot see a copy whose
bytes went wrong in place: another request's K/V copied over it, a reused slot whose
row was never written, a wrong dequantisation scale, a flipped bit, a kernel that wrote
one row off. A producer that keeps content digests says, on each ``write``, what the
block's digest is after the write, and on a ``read``, ``swap_in``, ``swap_out`` or
``recode``, the digest it recomputed over the bytes it actually read. The two must be
equal; a re-encode (``recode``, or a ``swap_out`` into a lossier codec) or a token merge
(``merge``) legitimately changes the bytes and says so with ``new_digest``, which later
reads must match.

The check judges only digests a producer gave: an event without one says nothing, and
a ``write`` without one leaves the block's content unknown until the next write that
has one. What a digest is, is the producer's business (kvdoctor's engine: see
``engine/kv/digest.py``); the check only compares.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..events import Alloc, Event, Evict, Free, Merge, Read, Recode, SwapIn, SwapOut, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["IntegrityCheck"]


class IntegrityCheck(CheckBase):
    name = "integrity"
    RULES = (
        Rule("read-mismatch", "error",
             "a read saw bytes whose digest differs from the one the last write into the block produced"),
        Rule("swap-mismatch", "error",
             "a swap moved bytes whose digest differs from the one the last write into the block produced"),
        Rule("recode-mismatch", "error",
             "a re-encode read bytes whose digest differs from the one the last write into the block produced"),
        Rule("merge-mismatch", "error",
             "a token merge read bytes whose digest differs from the one the last write into the block produced"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        # block -> (the digest its bytes must have, the event that set it: a write or a re-encode)
        self._expected: dict[int, tuple[int, Event]] = {}
        self._corrupt: set[int] = set()  # blocks already found corrupt in this life: one finding each

    def handlers(self):
        return {Write: self._write, Read: self._read, SwapOut: self._swap, SwapIn: self._swap,
                Recode: self._swap, Merge: self._swap, Alloc: self._forget, Free: self._forget, Evict: self._forget}

    def _forget(self, ev: Alloc | Free | Evict) -> Sequence[Finding]:
        self._expected.pop(ev.block, None)  # a new life of the id, or none: nothing known of its bytes
        self._corrupt.discard(ev.block)
        return NO_FINDINGS

    def _write(self, ev: Write) -> Sequence[Finding]:
        if ev.digest is None:
            self._expected.pop(ev.block, None)
        else:
            self._expected[ev.block] = (ev.digest, ev)
        return NO_FINDINGS

    def _read(self, ev: Read) -> Sequence[Finding]:
        digests = ev.digests
        if not digests:
            return NO_FINDINGS
        expected = self._expected
        out: list[Finding] = []
        for i, (block, seen) in enumerate(zip(ev.blocks, digests)):
            if seen is None:
                continue
            want = expected.get(block)
            if want is None or want[0] == seen:
                continue
            layers = ev.digest_layers
            layer = layers[i] if layers is not None and i < len(layers) and layers[i] is not None else ev.layer
            out.extend(self._mismatch("read-mismatch", ev, block, seen, want, seq=ev.seq, layer=layer,
                                      what=f"sequence {ev.seq!r} read"))
        return out

    def _swap(self, ev: SwapIn | SwapOut | Recode | Merge) -> Sequence[Finding]:
        out: Sequence[Finding] = NO_FINDINGS
        want = self._expected.get(ev.block)
        if ev.digest is not None and want is not None and want[0] != ev.digest:
            if type(ev) is Recode:
                rule, what = "recode-mismatch", f"recode {ev.src_codec}->{ev.dst_codec} in {ev.tier} read"
            elif type(ev) is Merge:
                rule, what = "merge-mismatch", f"token merge in {ev.tier} read"
            else:
                rule, what = "swap-mismatch", f"{type(ev).__struct_config__.tag} {ev.src}->{ev.dst} moved"
            out = self._mismatch(rule, ev, ev.block, ev.digest, want, seq=self.ledger.owner(ev.block),
                                 layer=ev.digest_layer, what=what)
        new = getattr(ev, "new_digest", None)
        if new is not None:
            self._expected[ev.block] = (new, ev)  # re-encoded: these are the bytes later reads must show
        elif type(ev) in (Recode, Merge) and want is not None:
            del self._expected[ev.block]  # re-encoded without a digest of the new bytes: unknown from here
        return out

    def _mismatch(self, rule: str, ev: Event, block: int, seen: int, want: tuple[int, Event], *, seq: Any,
                  layer: int | None, what: str) -> Sequence[Finding]:
        digest, source = want
        if block in self._corrupt or not self.once(rule, block, digest):
            return NO_FINDINGS
        self._corrupt.add(block)
        if type(source) is Write:
            where = (f"position {source.pos}" if source.n == 1
                     else f"positions {source.pos}-{source.pos + source.n - 1}")
            made = f"the last write into it (sequence {source.seq!r}, {where}, version {source.version}, step {source.step})"
        else:
            made = f"its {'token merge' if type(source) is Merge else 're-encode'} at step {source.step}"
        first = f" (first differing layer {layer})" if layer is not None else ""
        return [self.finding(
            rule,
            f"{what} block {block} with content digest {seen:#018x}, but {made} left {digest:#018x}{first}: "
            f"its bytes changed without a write",
            seq=seq, block=block, layer=layer, step=ev.step, seen_digest=seen, expected_digest=digest,
            last_write=self.event_dict(source), tier=self.ledger.tier.get(block),
            events=[self.event_dict(ev)], history=self.ledger.block_history(block),
        )]
