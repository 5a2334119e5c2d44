"""Handoff: K/V that one instance saves and another loads (disaggregated prefill and decode, a shared store).

A prefill instance computes a prompt's K/V and saves it through a KV connector (NIXL, LMCache, Mooncake,
vLLM's ``ExampleConnector`` through shared storage); a decode instance loads it into its own blocks and
goes on. Both ends must mean the same thing: the same block size and layout (vLLM #30358, #41037,
LMCache #4463, dynamo #14416), the same token count mapped onto blocks, and, once the bytes land, the
same content the source saved (a stale or foreign file in the store, a layout mismatch) — and the load
must not start before the save has finished (LMCache #4991, #2206: a partial store used as whole).

Each rank of an instance moves its own share of the K/V (its heads, its stage's layers), so every rank must
save each request its scheduler asked to save, every layer it holds (LMCache #1807: a rank that never
stores), and a destination rank must load every layer and block its source rank saved (vLLM #30358,
#41037: the two instances' block maps differ).

The two ends pair by ``key`` on ``transfer_start``, in two traces or in one (an instance that saves K/V and
loads it back later, ``kv_both``); the key is the same in every trace: a connector's file key, a
request's transfer id; a key ``K@R`` is rank ``R``'s share of ``K``. The content per block is ``digests`` on
the start (a save) or on the ``transfer_done`` (a load, whose bytes exist only then), over the ``layers``
the transfer moved. A save with a key and neither layers nor digests moves no bytes: it is a scheduler's
decision that the key be saved (with the request it is for), which a save of the bytes under that key by a
trace of the same instance must follow. A producer that leaves a field out is not judged on it. Saves are
remembered per key (the newest, up to ``KEYS_KEPT`` keys), so a workload of any length holds its memory flat.
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
        Rule("save-missing", "error",
             "a scheduler asked for a request's K/V to be saved under a key (a rank's share), and no trace of "
             "its instance saved it: a rank that never stores"),
        Rule("save-layers", "error", "a rank saved a request's K/V without some of the layers it holds"),
        Rule("partial-load", "error", "a rank loaded fewer layers or blocks of a key than the source rank saved"),
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
        # (instance, key) -> a scheduler's decision to save it, until a trace of the instance saves the bytes
        self.asked: OrderedDict[tuple, tuple[TraceTag, TransferStart]] = OrderedDict()
        self.saved: OrderedDict[tuple, None] = OrderedDict()  # (instance, key) of saves with bytes
        self.saving: set = set()  # instances some of whose traces save bytes (their workers)
        # (instance, key without its rank) -> each rank's key saved -> the store it went to
        self.shares: OrderedDict[tuple, dict[str, str | None]] = OrderedDict()

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
        if ev.op == "save" and ev.layers is None and ev.digests is None:  # a decision: no bytes moved here
            return out + self._ask(tag, ev)
        if ev.op == "save":
            out += self._saved(tag, ev)
            save = _Save(tag, ev, digests=ev.digests)
            self._remember(self.saves, ev.key, save)
            self.saves_by_id[(tag.index, ev.transfer)] = save
            return out
        if ev.seq is not None:
            self._remember(self.requests, (tag.header.instance, ev.key), ev.seq)
        save = self.saves.get(ev.key)
        load = _Load(tag, ev)
        self.loads[(tag.index, ev.transfer)] = load
        if save is None:
            return out  # saved before this workload began: nothing to pair
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
            short = self._partial(tag, ev, save, where)
            out += short
            if not short and (ev.layers is None or save.start.layers is None or ev.layers == save.start.layers):
                load.save = save  # digests are sums over layers: comparable only over the same layers
        return out

    def _shared(self, save: _Save) -> str:
        """Why the store may hold other K/V than this rank saved. Ranks of one stage hold the same layers: a
        connector that names an entry by the tokens alone (vLLM's ExampleConnector) writes all their heads to
        the same files, the last writer's winning. Stages hold different layers, whose files cannot collide
        unless a stage names a layer by its offset within the stage (vllm-ascend PR #15900)."""
        shares = self.shares.get((save.tag.header.instance, _base(save.start.key)), {})
        ranks = sorted(_rank_id(k) or "" for k, store in shares.items() if store == save.start.dst)
        stage = _stage(_rank_id(save.start.key))
        peers = [r for r in ranks if _stage(r) == stage]
        if len(peers) >= 2:
            return (f". Ranks {', '.join(peers)} of {save.tag.who} saved their shares of {_base(save.start.key)} to "
                    f"one store ({save.start.dst}): a connector that names an entry by the tokens alone (vLLM's "
                    "ExampleConnector does) writes every rank's heads to the same files, and each destination rank "
                    "loads whichever rank wrote last. Give each rank its own store path or key (the connector is not "
                    "made for tensor or pipeline parallel)")
        if len({_stage(r) for r in ranks}) >= 2:
            return (f". Pipeline stages {', '.join(ranks)} of {save.tag.who} saved their layers of "
                    f"{_base(save.start.key)} to one store ({save.start.dst}), each in files of its own layers: if "
                    "this is another stage's K/V, a stage names its layers' files by their offset within the stage "
                    "instead of in the model (vllm-ascend PR #15900) and overwrites the stage that holds those layers")
        return ""

    # ---- ranks that save and load their share ---------------------------------------------------

    def _remember(self, table: OrderedDict, key: Any, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > KEYS_KEPT:
            table.popitem(last=False)

    def _ask(self, tag: TraceTag, ev: TransferStart) -> list[Finding]:
        """A scheduler's decision that ``ev.key`` be saved: the bytes must follow from a trace of its instance."""
        at = (tag.header.instance, ev.key)
        if ev.seq is not None:
            self._remember(self.requests, at, ev.seq)
        if at not in self.saved:
            self._remember(self.asked, at, (tag, ev))
        return []

    def _saved(self, tag: TraceTag, ev: TransferStart) -> list[Finding]:
        """A save of the bytes: it answers its scheduler's decision, and it must hold every layer its rank holds."""
        at = (tag.header.instance, ev.key)
        self.asked.pop(at, None)
        self._remember(self.saved, at, None)
        if _rank_id(ev.key) is not None:
            where = (tag.header.instance, _base(ev.key))
            self._remember(self.shares, where, {**self.shares.get(where, {}), ev.key: ev.dst})
        self.saving.add(tag.header.instance)
        held = tag.header.layers
        missing = sorted(set(held) - set(ev.layers)) if held is not None and ev.layers is not None else []
        if not missing or not self.once("save-layers", tag.index, ev.transfer):
            return []
        seq = ev.seq if ev.seq is not None else self.requests.get(at)
        return [self.found(
            tag, "save-layers", f"{tag.who}{_rank(ev.key)} saved the K/V of request {seq!r} (key {ev.key}, blocks "
            f"{_blocks(ev.blocks)}) without {_layers(missing)}, which it holds: a destination loading that key gets "
            "no K/V of those layers from this rank", seq=seq, block=ev.blocks[0] if ev.blocks else None,
            layer=missing[0], step=ev.step, key=ev.key, rank=_rank_id(ev.key), missing_layers=missing,
            saved_layers=ev.layers, held_layers=held)]

    def _partial(self, tag: TraceTag, ev: TransferStart, save: _Save, where: dict) -> list[Finding]:
        """A load that covers fewer of the saved layers or blocks than its source rank saved."""
        fewer = sorted(set(save.start.layers) - set(ev.layers)) \
            if ev.layers is not None and save.start.layers is not None else []
        short = len(ev.blocks) < len(save.start.blocks)
        if not (fewer or short) or not self.once("partial-load", tag.index, ev.transfer):
            return []
        seq = where["seq"] if where["seq"] is not None else self.requests.get((tag.header.instance, ev.key))
        what = ([_layers(fewer)] if fewer else []) + \
            ([f"{len(save.start.blocks) - len(ev.blocks)} of its blocks"] if short else [])
        return [self.found(
            tag, "partial-load", f"{tag.who}{_rank(ev.key)} loaded the K/V of request {seq!r} (key {ev.key}) into blocks "
            f"{_blocks(ev.blocks)} without {' and '.join(what)} that {save.tag.who}{_rank(save.start.key)} saved: "
            "attention there reads K/V the handoff never brought", seq=seq, block=where["block"],
            layer=fewer[0] if fewer else None, step=ev.step, key=ev.key, rank=_rank_id(ev.key),
            missing_layers=fewer, loaded_layers=ev.layers, saved_layers=save.start.layers,
            blocks=ev.blocks, source_blocks=save.start.blocks, source_trace=save.tag.name)]

    def at_end(self) -> Sequence[Finding]:
        """Every trace ended: a decision to save that no trace of its instance answered is a rank that never
        stored that key (judged only for instances whose workers record the bytes they save)."""
        out: list[Finding] = []
        for (instance, key), (tag, ev) in self.asked.items():
            if instance not in self.saving or not self.once("save-missing", instance, key):
                continue
            peers = sorted(self.shares.get((instance, _base(key)), ()))
            said = f"; its peers saved {', '.join(peers)}" if peers else ""
            out.append(self.found(
                tag, "save-missing", f"{tag.who}'s scheduler asked for the K/V of request {ev.seq!r} (blocks "
                f"{_blocks(ev.blocks)}) to be saved under key {key}, but no{_rank(key) or ' trace'} of {tag.who} "
                f"saved it{said}: a destination finds that share missing or another's in its place",
                seq=ev.seq, block=ev.blocks[0] if ev.blocks else None, step=ev.step, key=key, rank=_rank_id(key),
                blocks=ev.blocks, peers_saved=peers))
        self.asked.clear()
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
                f"this key{self._shared(save)}", seq=seq, block=ev.blocks[i] if i < len(ev.blocks) else None,
                step=ev.step, key=ev.key,
                block_index=i, loaded_digest=got, saved_digest=saved, source_trace=save.tag.name,
                source_seq=save.start.seq, source_block=src_blocks[i] if i < len(src_blocks) else None,
                blocks_differing=sum(1 for a, b in zip(digests, save.digests) if a is not None and b is not None and a != b))]
        return []


def _base(key: str) -> str:
    """The key a rank's share (``K@R``) is a share of."""
    return key.partition("@")[0]


def _rank_id(key: str) -> str | None:
    return key.partition("@")[2] or None


def _stage(rank: str | None) -> str:
    """The pipeline stage of a rank id ``tp0pp1`` (``pp1``), or the whole id where it names none."""
    return (rank or "").partition("pp")[2] or (rank or "")


def _rank(key: str | None) -> str:
    """The words naming the rank whose share ``key`` is (nothing for a whole key)."""
    rank = _rank_id(key) if key else None
    return f" rank {rank}" if rank else ""


def _blocks(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks[:8])) + (f" … ({len(blocks)})" if len(blocks) > 8 else "")


def _layers(layers: list[int]) -> str:
    """"layer 3", "layers 0-11", "layers 1, 5"."""
    s = sorted(layers)
    if len(s) == 1:
        return f"layer {s[0]}"
    return f"layers {s[0]}-{s[-1]}" if s == list(range(s[0], s[-1] + 1)) else "layers " + ", ".join(map(str, s))


def _differ(a: Header, b: Header) -> list[str]:
    return [f for f in _LAYOUT if getattr(a, f) is not None and getattr(b, f) is not None and getattr(a, f) != getattr(b, f)]
