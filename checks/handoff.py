"""Handoff: K/V that one instance saves and another loads (disaggregated prefill and decode, a shared store).

A prefill instance computes a prompt's K/V and saves it through a KV connector (NIXL, LMCache, Mooncake,
vLLM's ``ExampleConnector`` through shared storage); a decode instance loads it into its own blocks and
goes on. Both ends must mean the same thing: the same block size and layout (vLLM #30358, #41037,
LMCache #4463, dynamo #14416), the same token count mapped onto blocks, and, once the bytes land, the
same content the source saved (a stale or foreign file in the store, a layout mismatch) — and the load
must not start before the save has finished (LMCache #4991, #2206: a partial store used as whole).

The two ends pair by ``key`` on ``transfer_start`` (the same in every trace: a connector's file key, a
request's transfer id); the content per block is ``digests`` on the start (a save) or on the
``transfer_done`` (a load, whose bytes exist only then). A producer that leaves a field out is not judged
on it. Saves are remembered per key (the newest, up to ``KEYS_KEPT`` keys), so a workload of any length
holds its memory flat.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..events import TIERS, Header, TransferDone, TransferFailed, TransferStart
from ..findings import Finding

from .across import AcrossCheck, TraceTag
from .base import NO_FINDINGS, Rule

__all__ = ["HandoffCheck", "KEYS_KEPT"]

KEYS_KEPT = 100_000  # saved keys remembered for the loads that may follow
# What both ends of a handoff must agree on to mean the same bytes by the same block ids.
_LAYOUT = ("block_size", "kernel_block_size", "kv_layout", "num_layers")


@dataclass
class _Save:
    tag: TraceTag
    start: TransferStart
    state: str = "in flight"  # "in flight", "done", "failed"
    digests: list[int | None] | None = None


@dataclass
class _Load:
    tag: TraceTag
    start: TransferStart
    save: _Save | None = None  # the save it pairs with, when its bytes can be compared
    checked: set = field(default_factory=set)


class HandoffCheck(AcrossCheck):
    name = "handoff"
    RULES = (
        Rule("layout-mismatch", "error",
             "two instances handing K/V over disagree on block size, kernel block size, K/V layout or layer count"),
        Rule("block-map", "error",
             "a transfer's blocks do not hold its token count at its block size, or the two ends map different "
             "token counts"),
        Rule("load-unsaved", "error", "an instance loaded K/V whose save had not finished, or had failed"),
        Rule("digest-mismatch", "error",
             "the K/V an instance loaded differs from what the source saved under that key (a stale or foreign "
             "entry in the store, a layout mismatch)"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self.saves: OrderedDict[str, _Save] = OrderedDict()
        self.saves_by_id: dict[tuple[int, str], _Save] = {}  # (trace, transfer) -> a save still open
        self.loads: dict[tuple[int, str], _Load] = {}  # (trace, transfer) -> a load still open
        # (instance, key) -> the request a load was for, where one trace of the instance names it (a scheduler)
        # and another has the bytes (its worker)
        self.requests: OrderedDict[tuple, Any] = OrderedDict()
        self.stores: dict[str, TraceTag] = {}  # a store transfers go through (not a tier) -> the first trace using it

    def wants(self, tag: TraceTag) -> tuple[type, ...]:
        return (TransferStart, TransferDone, TransferFailed)

    def see(self, tag: TraceTag, event: Any) -> Sequence[Finding]:
        kind = type(event)
        if kind is TransferStart:
            return self._start(tag, event)
        at = (tag.index, event.transfer)
        save = self.saves_by_id.pop(at, None)
        if save is not None:
            save.state = "failed" if kind is TransferFailed else "done"
            if kind is TransferDone and event.digests is not None:
                save.digests = event.digests
            return NO_FINDINGS
        load = self.loads.pop(at, None)
        if load is None or kind is TransferFailed:
            return NO_FINDINGS  # a failed load's blocks are the transfer check's (failed-load-read)
        digests = event.digests if event.digests is not None else load.start.digests
        return self._compare(load, digests)

    def _start(self, tag: TraceTag, ev: TransferStart) -> list[Finding]:
        out = self._block_map(tag, ev) + self._store(tag, ev)
        if ev.key is None or ev.op not in ("save", "load"):
            return out
        if ev.op == "save":
            save = _Save(tag, ev, digests=ev.digests)
            self.saves[ev.key] = save
            self.saves.move_to_end(ev.key)
            if len(self.saves) > KEYS_KEPT:
                self.saves.popitem(last=False)
            self.saves_by_id[(tag.index, ev.transfer)] = save
            return out
        if ev.seq is not None:
            self.requests[(tag.header.instance, ev.key)] = ev.seq
            if len(self.requests) > KEYS_KEPT:
                self.requests.popitem(last=False)
        save = self.saves.get(ev.key)
        load = _Load(tag, ev)
        self.loads[(tag.index, ev.transfer)] = load
        if save is None or save.tag.index == tag.index:
            return out  # saved before this workload began, or by this instance itself: nothing to pair
        where = dict(seq=ev.seq, block=ev.blocks[0] if ev.blocks else None, step=ev.step)
        if save.state != "done" and self.once("load-unsaved", tag.index, ev.transfer):
            out.append(self.found(
                tag, "load-unsaved", f"{tag.who} loaded {ev.seq!r}'s K/V (key {ev.key}) while {save.tag.who}'s "
                f"save of it was {save.state}: the destination may read partial or no K/V", key=ev.key,
                save_state=save.state, source_trace=save.tag.name, source_seq=save.start.seq, **where))
        facts = _differ(tag.header, save.tag.header)
        if facts and self.once("layout-mismatch", min(tag.index, save.tag.index), max(tag.index, save.tag.index)):
            out.append(self.found(
                tag, "layout-mismatch", f"{tag.who} loads K/V that {save.tag.who} saved, but they differ in "
                + ", ".join(f"{f} ({getattr(tag.header, f)} here, {getattr(save.tag.header, f)} at the source)"
                            for f in facts), key=ev.key, source_trace=save.tag.name, facts=facts, **where))
        elif ev.num_tokens is not None and save.start.num_tokens is not None \
                and ev.num_tokens != save.start.num_tokens and self.once("block-map", tag.index, ev.transfer):
            out.append(self.found(
                tag, "block-map", f"{tag.who} maps {ev.num_tokens} tokens of key {ev.key} onto its blocks where "
                f"{save.tag.who} saved {save.start.num_tokens}", key=ev.key, source_trace=save.tag.name,
                num_tokens=ev.num_tokens, source_num_tokens=save.start.num_tokens, **where))
        else:
            load.save = save
        return out

    def _store(self, tag: TraceTag, ev: TransferStart) -> list[Finding]:
        """Instances that save to or load from one store must lay K/V out alike, whether or not a key pairs
        (a block size that differs changes the keys: every lookup misses, and nothing is handed over)."""
        store = ev.dst if ev.op == "save" else ev.src
        if store is None or store in TIERS or tag.header.instance is None:
            return []
        first = self.stores.setdefault(store, tag)
        if first.header.instance in (None, tag.header.instance):
            return []
        facts = _differ(tag.header, first.header)
        pair = (min(tag.index, first.index), max(tag.index, first.index))
        if not facts or not self.once("layout-mismatch", *pair):
            return []
        return [self.found(
            tag, "layout-mismatch", f"{tag.who} and {first.who} share the store {store}, but differ in "
            + ", ".join(f"{f} ({getattr(tag.header, f)} here, {getattr(first.header, f)} there)" for f in facts),
            seq=ev.seq, step=ev.step, store=store, other_trace=first.name, facts=facts)]

    def _block_map(self, tag: TraceTag, ev: TransferStart) -> list[Finding]:
        size = tag.header.block_size
        if ev.num_tokens is None or size <= 0:
            return []
        need = -(-ev.num_tokens // size)
        if need == len(ev.blocks) or not self.once("block-map", tag.index, ev.transfer):
            return []
        return [self.found(tag, "block-map", f"{tag.who}'s {ev.op} of {ev.seq!r} lists {len(ev.blocks)} blocks for "
                           f"{ev.num_tokens} tokens at block size {size} (needs {need})", seq=ev.seq, step=ev.step,
                           block=ev.blocks[0] if ev.blocks else None, blocks=ev.blocks, num_tokens=ev.num_tokens,
                           key=ev.key)]

    def _compare(self, load: _Load, digests: list[int | None] | None) -> list[Finding]:
        save = load.save
        if save is None or digests is None or save.digests is None:
            return []
        ev = load.start
        for i, (got, saved) in enumerate(zip(digests, save.digests)):
            if got is None or saved is None or got == saved:
                continue
            if not self.once("digest-mismatch", load.tag.index, ev.transfer):
                return []
            src_blocks = save.start.blocks
            seq = ev.seq if ev.seq is not None else self.requests.get((load.tag.header.instance, ev.key))
            source = f" for request {save.start.seq!r}" if save.start.seq is not None else ""
            whose = f"request {seq!r}'s" if seq is not None else "the"
            return [self.found(
                load.tag, "digest-mismatch",
                f"{load.tag.who} loaded {whose} K/V (key {ev.key}) into block {ev.blocks[i]}, but its content differs from what {save.tag.who} saved"
                f"{source} (block {src_blocks[i] if i < len(src_blocks) else '?'}): the store held other K/V under "
                "this key", seq=seq, block=ev.blocks[i] if i < len(ev.blocks) else None, step=ev.step, key=ev.key,
                block_index=i, loaded_digest=got, saved_digest=saved, source_trace=save.tag.name,
                source_seq=save.start.seq, source_block=src_blocks[i] if i < len(src_blocks) else None,
                blocks_differing=sum(1 for a, b in zip(digests, save.digests) if a is not None and b is not None and a != b))]
        return []


def _differ(a: Header, b: Header) -> list[str]:
    return [f for f in _LAYOUT if getattr(a, f) is not None and getattr(b, f) is not None and getattr(a, f) != getattr(b, f)]
