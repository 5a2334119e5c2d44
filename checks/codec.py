"""Codecs: a block's precision only ever goes down, and a re-encode works on the block's latest copy.

A quantizing cache stores a block under the codec of its tier or of its importance
(FP16 on the device, INT8 on the host, NF4 on disk, or NF4 for blocks attention
ignores). Quantizing throws information away for good: a block whose bytes went
through NF4 holds NF4's precision wherever it moves next. So an event that shows a
copy of the block at a *better* precision than it already lost is a bug: a stale
higher-precision copy was served, or the bytes are labelled with the wrong codec and
will be decoded as garbage — the silent kind of compression bug. A ``recode`` must
re-encode the block's current copy (its version is the last write's), where it sits.

Codecs are ranked by what they keep: FP32, then FP16 and BF16 (different, neither
strictly better), then INT8, then NF4. A codec name this check does not know is
not judged.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..events import Alloc, Event, Evict, Free, Recode, SwapIn, SwapOut
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["CodecCheck", "CODEC_RANK"]

CODEC_RANK: dict[str, int] = {"fp32": 0, "fp16": 1, "bf16": 1, "int8": 2, "nf4": 3}  # higher loses more


class CodecCheck(CheckBase):
    name = "codec"
    RULES = (
        Rule("precision-regained", "error",
             "a copy of a block shows a better codec than one its bytes already went through"),
        Rule("recode-stale", "error", "a recode re-encoded an older copy than the block's last write"),
        Rule("recode-misplaced", "error", "a recode names a tier the block is not in, or a block not allocated"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self._worst: dict[int, str] = {}  # block -> the lossiest known codec its bytes went through

    def handlers(self):
        return {Alloc: self._alloc, SwapOut: self._move, SwapIn: self._move, Recode: self._recode,
                Free: self._gone, Evict: self._gone}

    def _alloc(self, ev: Alloc) -> Sequence[Finding]:
        if ev.codec is None:
            self._worst.pop(ev.block, None)  # a new life of the id: nothing known of its codec
        else:
            self._worst[ev.block] = ev.codec
        return NO_FINDINGS

    def _gone(self, ev: Free | Evict) -> Sequence[Finding]:
        # Every copy is gone and the id's next life starts with an alloc that resets it: keeping it
        # would grow with every block id a long run ever frees.
        self._worst.pop(ev.block, None)
        return NO_FINDINGS

    def _move(self, ev: SwapIn | SwapOut) -> Sequence[Finding]:
        if ev.codec is None:
            return NO_FINDINGS
        return self._arrive(ev, ev.block, ev.codec, f"{type(ev).__struct_config__.tag} {ev.src}->{ev.dst}")

    def _recode(self, ev: Recode) -> Sequence[Finding]:
        out: list[Finding] = []
        where = self.ledger.tier.get(ev.block)
        if where != ev.tier and self.once("recode-misplaced", ev.block, ev.step):
            said = "is not allocated" if where is None else f"sits in {where}"
            out.append(self._finding("recode-misplaced", ev, f"recode of block {ev.block} in {ev.tier}, "
                                     f"but the block {said}", tier=where))
        last = self.ledger.version.get(ev.block)
        if last is not None and ev.version < last and self.once("recode-stale", ev.block, last):
            out.append(self._finding("recode-stale", ev, f"recode {ev.src_codec}->{ev.dst_codec} of block {ev.block} "
                                     f"re-encoded version {ev.version}, but the last write made version {last}",
                                     seen_version=ev.version, last_write_version=last))
        out.extend(self._arrive(ev, ev.block, ev.dst_codec, f"recode {ev.src_codec}->{ev.dst_codec}"))
        return out

    def _arrive(self, ev: Event, block: int, codec: str, what: str) -> Sequence[Finding]:
        """The block's bytes are now held as ``codec``: worse than known is the new floor, better is a finding."""
        worst = self._worst.get(block)
        rank = CODEC_RANK.get(codec)
        if worst is None or rank is None or CODEC_RANK.get(worst) is None:
            self._worst[block] = codec
            return NO_FINDINGS
        if rank > CODEC_RANK[worst]:
            self._worst[block] = codec
            return NO_FINDINGS
        if rank == CODEC_RANK[worst] and codec != worst:  # fp16 <-> bf16: neither keeps what the other lost
            self._worst[block] = codec
        if rank >= CODEC_RANK[worst] or not self.once("precision-regained", block, worst):
            return NO_FINDINGS
        return [self._finding("precision-regained", ev, f"{what} shows block {block} as {codec}, but its bytes "
                              f"already went through {worst}: a stale higher-precision copy, or bytes "
                              f"labelled with the wrong codec", codec=codec, lossiest_before=worst)]

    def _finding(self, rule: str, ev: Any, message: str, **evidence: Any) -> Finding:
        block = ev.block
        owners = self.ledger.owners.get(block)
        seq = sorted(owners, key=str)[0] if owners else None
        return self.finding(rule, message, seq=seq, block=block, step=ev.step, events=[self.event_dict(ev)],
                            history=self.ledger.block_history(block), **evidence)
