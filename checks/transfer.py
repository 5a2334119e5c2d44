"""Transfer: blocks touched while asynchronous work on them is in flight, and transfers that never end.

A KV connector sending a finished request's blocks, an offload store reading them, a load writing K/V that
came from outside: each runs beside the engine, and the engine must leave the blocks alone until it is
done. The field's reports are all one class: blocks freed and handed to another request while an
asynchronous store still reads them (vLLM #52360, sglang #32564), freed while RDMA writes land (vLLM PR
#56104, #50754), a partial or failed load used as if it were whole (LMCache #4991, #2206), a delayed
free waiting for a completion that never comes (vLLM #46283). ``transfer_start`` opens a transfer over
its blocks, ``transfer_done``/``transfer_failed`` close it; the rules judge what happens to the blocks
in between, and after a failed load.

What a transfer does to its blocks is its ``op``: a ``save`` reads them out, a ``load`` writes K/V from
outside into them (until done they hold nothing valid, and a failed load leaves them so), a ``move`` copies
blocks the engine keeps between its own tiers (a prefetch, an asynchronous swap: they stay valid where they
were until it is done, and a failed move leaves them there, so reading them is no error). Every op's blocks
must not be freed, handed out or written while it is in flight.
"""

from __future__ import annotations

from typing import Sequence

from ..events import (Alloc, Evict, Free, Read, StepEnd, SwapIn, SwapOut, TransferDone, TransferFailed, TransferStart,
                      Write)
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["TransferCheck", "DEFAULT_LEASE_STEPS"]

DEFAULT_LEASE_STEPS = 500  # steps an open transfer may take when its producer names no lease
_DOES = {"save": "reads it out", "load": "writes it in", "move": "copies it between tiers"}  # what each op does


class TransferCheck(CheckBase):
    name = "transfer"
    RULES = (
        Rule("freed-in-flight", "error", "a block was freed, evicted or handed out again while a transfer still used it"),
        Rule("written-in-flight", "error", "a block was written while a transfer still read it out (save) or wrote it (load)"),
        Rule("read-in-flight", "error", "a block was read before the load writing it had finished"),
        Rule("moved-in-flight", "error",
             "a block was swapped to another tier while a transfer over it was in flight: the transfer's copy lands "
             "in, or reads, a slot the block has left"),
        Rule("failed-load-read", "error", "a block was read after the load that was to fill it failed, with no write since"),
        Rule("never-completed", "error", "a transfer stayed open past its lease while the engine went on"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self.open: dict[str, TransferStart] = {}
        self.in_flight: dict[int, list[str]] = {}  # block -> open transfers over it
        self.failed: dict[int, TransferFailed] = {}  # block -> the failed load that left it without valid bytes

    def handlers(self):
        return {TransferStart: self._start, TransferDone: self._done, TransferFailed: self._failed,
                Free: self._gone, Evict: self._gone, Alloc: self._gone, Write: self._write, Read: self._read,
                SwapIn: self._swap, SwapOut: self._swap, StepEnd: self._step}

    def _start(self, ev: TransferStart) -> Sequence[Finding]:
        self.open[ev.transfer] = ev
        for block in ev.blocks:
            self.in_flight.setdefault(block, []).append(ev.transfer)
            self.failed.pop(block, None)
        return NO_FINDINGS

    def _close(self, transfer: str) -> TransferStart | None:
        start = self.open.pop(transfer, None)
        if start is not None:
            for block in start.blocks:
                ids = self.in_flight.get(block)
                if ids is not None and transfer in ids:
                    ids.remove(transfer)
                    if not ids:
                        del self.in_flight[block]
        return start

    def _done(self, ev: TransferDone) -> Sequence[Finding]:
        self._close(ev.transfer)
        return NO_FINDINGS

    def _failed(self, ev: TransferFailed) -> Sequence[Finding]:
        start = self._close(ev.transfer)
        if start is not None and start.op == "load":  # a save or a move failing loses nothing of the blocks
            for block in start.blocks:
                self.failed[block] = ev
        return NO_FINDINGS

    def _flight(self, block: int) -> TransferStart | None:
        ids = self.in_flight.get(block)
        return self.open[ids[0]] if ids else None

    def _gone(self, ev: Free | Evict | Alloc) -> Sequence[Finding]:
        self.failed.pop(ev.block, None)
        start = self._flight(ev.block)
        # the id names another block from here on: the transfer's claim stays with the block that was freed
        self.in_flight.pop(ev.block, None)
        if start is None or not self.once("freed-in-flight", start.transfer, ev.block):
            return NO_FINDINGS
        what = {"free": "freed", "evict": "evicted", "alloc": f"handed to {getattr(ev, 'seq', None)!r}"}[ev.__struct_config__.tag]
        return [self._finding("freed-in-flight", start, ev, ev.block, f"block {ev.block} was {what} at step {ev.step}")]

    def _write(self, ev: Write) -> Sequence[Finding]:
        self.failed.pop(ev.block, None)
        start = self._flight(ev.block)
        if start is None or not self.once("written-in-flight", start.transfer, ev.block):
            return NO_FINDINGS
        return [self._finding("written-in-flight", start, ev, ev.block,
                              f"sequence {ev.seq!r} wrote tokens {ev.pos}..{ev.pos + ev.n - 1} into block {ev.block} "
                              f"at step {ev.step}")]

    def _swap(self, ev: SwapIn | SwapOut) -> Sequence[Finding]:
        start = self._flight(ev.block)
        if start is None or not self.once("moved-in-flight", start.transfer, ev.block):
            return NO_FINDINGS
        return [self._finding("moved-in-flight", start, ev, ev.block,
                              f"block {ev.block} was swapped {ev.src}->{ev.dst} at step {ev.step}")]

    def _read(self, ev: Read) -> Sequence[Finding]:
        if not self.in_flight and not self.failed:
            return NO_FINDINGS
        out: list[Finding] = []
        for block in ev.blocks:
            start = self._flight(block)
            if start is not None and start.op == "load" and self.once("read-in-flight", start.transfer, block):
                out.append(self._finding("read-in-flight", start, ev, block,
                                         f"sequence {ev.seq!r} read block {block} at step {ev.step}"))
            failed = self.failed.get(block)
            if failed is not None and self.once("failed-load-read", failed.transfer, block):
                out.append(self.finding(
                    "failed-load-read",
                    f"sequence {ev.seq!r} read block {block} at step {ev.step}, but the load {failed.transfer!r} that was "
                    f"to fill it failed at step {failed.step} ({failed.reason or 'no reason given'}) and nothing wrote "
                    f"it since: its K/V are not what the sequence's tokens make",
                    seq=ev.seq, block=block, step=ev.step, transfer=failed.transfer,
                    events=[self.event_dict(failed), self.event_dict(ev)]))
        return out

    def _step(self, ev: StepEnd) -> Sequence[Finding]:
        out: list[Finding] = []
        for start in list(self.open.values()):
            lease = start.lease_steps or DEFAULT_LEASE_STEPS
            if ev.step - start.step > lease and self.once("never-completed", start.transfer):
                out.append(self.finding(
                    "never-completed",
                    f"{start.op} {start.transfer!r} of {len(start.blocks)} block(s)"
                    f"{f' for {start.seq!r}' if start.seq is not None else ''} started at step {start.step} and has not "
                    f"finished {ev.step - start.step} steps later (lease {lease}): its blocks stay held, and whatever "
                    f"waits for it waits forever",
                    seq=start.seq, block=start.blocks[0] if start.blocks else None, step=start.step,
                    transfer=start.transfer, blocks=list(start.blocks), events=[self.event_dict(start)]))
        return out

    def _finding(self, rule: str, start: TransferStart, ev, block: int, what: str) -> Finding:
        direction = _DOES.get(start.op, "uses it")
        return self.finding(
            rule,
            f"{what} while {start.op} {start.transfer!r} (started at step {start.step}"
            f"{f' for {start.seq!r}' if start.seq is not None else ''}) still {direction}: the transfer races the "
            f"engine, so the K/V it moves or leaves behind are not the block's",
            seq=getattr(ev, "seq", None) if getattr(ev, "seq", None) is not None else start.seq,
            block=block, step=ev.step, transfer=start.transfer,
            events=[self.event_dict(start), self.event_dict(ev)])
