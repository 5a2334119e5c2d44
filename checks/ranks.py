"""Ranks: the processes of one engine (tensor- and pipeline-parallel ranks) must agree.

Every rank of an engine runs the same scheduler decisions over its share of the model: the same blocks
to the same requests at the same step, the same batch. When ranks decide apart, the field sees
out-of-range block ids (vLLM PR #50653), ranks that evict differently and then deadlock (sglang #28429,
#33442, PR #10214), or one rank that never stores (LMCache #1807). Pipeline stages each hold a slice of
the layers; K/V landing at another stage's layer offsets looks healthy to the hit rate (vllm-ascend PR
#15900). The rules read each trace's header (``instance``, ``dp_rank``, ``tp_rank``/``pp_rank``,
``layers``) and compare the ranks of one engine step by step; a trace whose header names no rank is an
engine of its own and is not compared.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

import msgspec

from ..events import (Alloc, Batch, Evict, Free, Header, Read, Release, SeqEnd, SeqStart, Share, StepEnd, Write, decode,
                      encode)
from ..findings import Finding

from .across import AcrossCheck, TraceTag
from .base import NO_FINDINGS, Rule

__all__ = ["RanksCheck"]

# What every rank of an engine must agree on at start-up; ``layers`` only among ranks of one pipeline stage.
_SHARED_FACTS = ("block_size", "kernel_block_size", "kv_layout", "num_layers", "dp_size", "tp_size", "pp_size")
# What every rank records alike: the scheduler's decisions, and the writes and block-table reads they make
# (a rank's slot mapping and block table are its own copies: a rank skipping a write or reading another table
# diverges here). A read at one layer is a stage's own and is judged by ``foreign-layer`` instead.
_DECISIONS = (SeqStart, SeqEnd, Alloc, Share, Release, Free, Evict, Batch, Write, Read)
_PENDING_STEPS = 4096  # steps one rank may run ahead of a lagging one before its oldest are dropped unjudged


# What a scheduler decided, as ranks of one engine must all record it (no timings, no digests): one function
# per kind, found by the event's type, since this runs for most events of every rank's trace.
_DECIDE: dict[type, Any] = {
    Batch: lambda ev: ("batch", tuple(ev.rows), tuple(ev.positions), tuple(ev.n)),
    SeqStart: lambda ev: ("seq_start", ev.seq, ev.prompt_len),
    SeqEnd: lambda ev: ("seq_end", ev.seq, ev.reason),
    Alloc: lambda ev: ("alloc", ev.block, ev.tier, ev.seq),
    Evict: lambda ev: ("evict", ev.block, ev.tier, None),
    Share: lambda ev: ("share", ev.block, ev.seq),
    Release: lambda ev: ("release", ev.block, ev.seq),
    Write: lambda ev: ("write", ev.block, ev.seq, ev.pos, ev.n),
    Read: lambda ev: ("read", ev.seq, tuple(ev.blocks)),
    Free: lambda ev: ("free", ev.block),
}
_WANTED = frozenset((*_DECISIONS, StepEnd))


def _block_and_seq(decision: tuple | None) -> tuple[Any, Any]:
    """The block and the request a decision is about (None where it names none)."""
    if decision is None:
        return None, None
    kind = decision[0]
    if kind in ("alloc", "evict"):
        return decision[1], decision[-1]
    if kind in ("share", "release", "write"):
        return decision[1], decision[2]
    if kind == "free":
        return decision[1], None
    if kind == "read":
        return (decision[2][0] if decision[2] else None), decision[1]
    return None, (decision[1] if kind in ("seq_start", "seq_end") else None)


def _say(decision: tuple | None) -> str:
    return "nothing" if decision is None else " ".join(str(x) for x in decision if x is not None)


def _device_capacity(h: Header) -> int | None:
    return next((t.capacity_blocks for t in h.tiers if t.name == "device"), None)


# What a rank's recorder hands the rule, in the order its trace showed it (tuples: msgspec-encodable, so a worker
# process reading the trace can send them): a step closed (its decisions' digest and count, and the decisions
# themselves where the recorder keeps them), the trace moved on to another step, a read at a layer not the rank's.
_CLOSED, _STEP, _LAYER = 0, 1, 2


def _digest(decisions: list[tuple]) -> bytes:
    """Equal for equal decision lists (ints and strings only, so their encoding is one-to-one), 16 bytes for any."""
    return hashlib.blake2b(msgspec.msgpack.encode(decisions), digest_size=16).digest()


class RankRecorder:
    """One rank's trace as the ranks rule needs it, made where the trace is read: each step's decisions as a digest
    (and, when ``keep``, the decisions too, for the evidence of a divergence), the steps it moved through, its reads
    at layers its stage does not hold. A process that checks a finished trace on its own sends these records (a few
    bytes a step) instead of the decisions; the rule asks for the decisions of a step again only where two ranks
    differ (``AcrossCheck.reread``)."""

    def __init__(self, tag: TraceTag, keep: bool = True) -> None:
        self.held = tag.header.layers
        self.keep = keep
        self.step = -1  # the step being recorded (-1: no event yet)
        self.done_through = -1  # every step up to this one is complete
        self.current: list[tuple] = []

    def _close(self, out: list) -> None:
        if self.step >= 0 and self.step > self.done_through:
            current = self.current
            if current:
                out.append((_CLOSED, self.step, _digest(current), len(current), current if self.keep else None))
            else:
                out.append((_CLOSED, self.step, None, 0, None))
            self.current = []
            self.done_through = self.step

    def record(self, events: Iterable[Any]) -> list[tuple]:
        """The records of a batch of the trace's events (all kinds, in the trace's order)."""
        out: list[tuple] = []
        wanted, decide, step = _WANTED, _DECIDE, self.step
        current = self.current
        for event in events:
            kind = type(event)
            if kind not in wanted:
                continue
            if event.step != step:
                if step >= 0:
                    self._close(out)
                step = self.step = event.step
                current = self.current
                out.append((_STEP,))
            if kind is StepEnd:
                self._close(out)
                current = self.current
            elif kind is Read and event.layer is not None:
                if self.held is not None and event.layer not in self.held:
                    out.append((_LAYER, encode(event)))
            else:
                current.append(decide[kind](event))
        return out

    def end(self) -> list[tuple]:
        """The records the trace's end completes (its last step)."""
        out: list[tuple] = []
        self._close(out)
        return out


class _Rank:
    """One rank's closed steps (their records), kept until every rank of its engine has finished them."""

    def __init__(self, tag: TraceTag) -> None:
        self.tag = tag
        self.done_through = -1  # every step up to this one is complete
        self.forgot_through = -1  # steps up to this one were judged or dropped: no record is not "nothing"
        self.steps: dict[int, tuple] = {}  # step -> its _CLOSED record, for steps with decisions
        self.ended = False


class RanksCheck(AcrossCheck):
    name = "ranks"
    merged = False  # each rank's steps are compared once all ranks finished them: no order across traces needed
    RULES = (
        Rule("startup-mismatch", "error",
             "ranks of one engine started with different block sizes, layouts, layer counts, parallel sizes or pools"),
        Rule("stage-layers", "error",
             "pipeline stages hold overlapping layers, or layers the model does not have"),
        Rule("foreign-layer", "error", "a rank read K/V at a layer its pipeline stage does not hold"),
        Rule("divergence", "error",
             "ranks of one engine recorded different scheduler decisions (allocation, frees, batch) for one step"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self.engines: dict[tuple, list[_Rank]] = {}
        self.ranks: dict[int, _Rank] = {}  # trace index -> its rank
        self._reread_steps: dict[tuple[int, int], list] = {}  # (trace index, step) -> its decisions, read again

    def wants(self, tag: TraceTag) -> tuple[type, ...]:
        if tag.engine_key is None:
            return ()
        return (*_DECISIONS, StepEnd)

    def trace_added(self, tag: TraceTag) -> Sequence[Finding]:
        key = tag.engine_key
        if key is None:
            return NO_FINDINGS
        rank = self.ranks[tag.index] = _Rank(tag)
        peers = self.engines.setdefault(key, [])
        peers.append(rank)
        return self._startup(tag, [p.tag for p in peers if p is not rank])

    def _startup(self, tag: TraceTag, peers: list[TraceTag]) -> list[Finding]:
        out: list[Finding] = []
        h = tag.header
        if h.layers is not None and any(not 0 <= layer < h.num_layers for layer in h.layers) \
                and self.once("stage-layers", tag.index):
            out.append(self.found(tag, "stage-layers", f"{tag.who} holds layers {h.layers}, but the model has "
                                  f"{h.num_layers} (0-{h.num_layers - 1})", layers=h.layers, num_layers=h.num_layers))
        if not peers:
            return out
        first = peers[0]
        g = first.header
        facts = [f for f in _SHARED_FACTS if getattr(h, f) != getattr(g, f)]
        if _device_capacity(h) != _device_capacity(g):
            facts.append("device blocks")
        if h.pp_rank == g.pp_rank and h.layers != g.layers:
            facts.append("layers")
        if facts and self.once("startup-mismatch", tag.index):
            mine = {f: (_device_capacity(h) if f == "device blocks" else getattr(h, f)) for f in facts}
            theirs = {f: (_device_capacity(g) if f == "device blocks" else getattr(g, f)) for f in facts}
            out.append(self.found(tag, "startup-mismatch",
                                  f"{tag.who} started with {_facts(mine)} where {first.who} has {_facts(theirs)}",
                                  mine=mine, theirs=theirs, other_trace=first.name))
        if h.layers is not None and h.pp_rank is not None:
            for peer in peers:
                p = peer.header
                if p.pp_rank is None or p.pp_rank == h.pp_rank or p.layers is None:
                    continue
                both = sorted(set(h.layers) & set(p.layers))
                if both and self.once("stage-layers", tag.index, peer.index):
                    out.append(self.found(tag, "stage-layers", f"{tag.who} and {peer.who} are different pipeline "
                                          f"stages but both hold layers {_span(both)}", layer=both[0],
                                          layers=both, other_trace=peer.name))
        return out

    def recorder(self, tag: TraceTag, keep: bool = True) -> RankRecorder | None:
        return RankRecorder(tag, keep) if tag.engine_key is not None else None

    def see_records(self, tag: TraceTag, records: Sequence[Any], ended: bool = False) -> Sequence[Finding]:
        """Take in a batch's records step by step; then compare the steps every rank has finished (once a batch:
        a step is compared when its last rank finished it, whichever event that was). A rank whose trace ended is
        judged up to its end and then left out (what it did not record is not a decision)."""
        rank = self.ranks.get(tag.index)
        if rank is None:
            return NO_FINDINGS
        out: list[Finding] = []
        key = tag.engine_key
        steps = rank.steps
        for rec in records:
            kind = rec[0]
            if kind == _CLOSED:
                rank.done_through = rec[1]
                if rec[2] is not None:
                    steps[rec[1]] = rec
                    if len(steps) > _PENDING_STEPS:
                        dropped = next(iter(steps))
                        del steps[dropped]
                        rank.forgot_through = max(rank.forgot_through, dropped)
            elif kind == _STEP:
                if len(steps) >= _PENDING_STEPS // 2:  # a batch of many short steps: compare before any drops
                    out.extend(self._judge(key))
            else:
                out.extend(self._layer(rank, decode(rec[1])))
        if ended:
            rank.ended = True
        out.extend(self._judge(key))
        return out

    def _layer(self, rank: _Rank, ev: Read) -> Sequence[Finding]:
        held = rank.tag.header.layers
        if ev.layer is None or held is None or ev.layer in held or not self.once("foreign-layer", rank.tag.index, ev.layer):
            return NO_FINDINGS
        tag = rank.tag
        return [self.found(tag, "foreign-layer", f"{tag.who} read K/V of {ev.seq!r} at layer {ev.layer}, which its "
                           f"stage does not hold (it holds {_span(held)})", seq=ev.seq, layer=ev.layer, step=ev.step,
                           block=ev.blocks[0] if ev.blocks else None, held=held, event=self.event_dict(ev))]

    def _judge(self, key: Any) -> list[Finding]:
        """Compare every step all of ``key``'s ranks have finished. While the header's parallel sizes say a rank
        has not shown its trace yet (a worker's trace found after its peers'), nothing is judged until it does or
        every rank shown has ended: a step judged without it would be gone when it joins."""
        peers = self.engines.get(key, [])
        live = [r for r in peers if not r.ended]
        if live and len(peers) < _expected_ranks(peers[0].tag.header):
            return []
        through = min((r.done_through for r in live), default=None)
        out: list[Finding] = []
        steps = sorted({s for r in peers for s in r.steps if through is None or s <= through})
        for step in steps:
            members = [r for r in peers if r.done_through >= step and (step in r.steps or step > r.forgot_through)]
            if len(members) > 1:
                out.extend(self._compare(step, members))
            for r in peers:
                r.steps.pop(step, None)
        for r in peers:
            r.forgot_through = max(r.forgot_through, r.done_through if through is None else min(r.done_through, through))
        return out

    def _compare(self, step: int, members: list[_Rank]) -> list[Finding]:
        ref = members[0]
        mine_rec = ref.steps.get(step)
        out: list[Finding] = []
        for other in members[1:]:
            theirs_rec = other.steps.get(step)
            if _digest_of(theirs_rec) == _digest_of(mine_rec) or not self.once("divergence", other.tag.index):
                continue
            mine, theirs = self._decisions(ref, mine_rec), self._decisions(other, theirs_rec)
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            a = mine[i] if i < len(mine) else None
            b = theirs[i] if i < len(theirs) else None
            named = [_block_and_seq(d) for d in (b, a)]
            block = next((blk for blk, _ in named if blk is not None), None)
            seq = next((sq for _, sq in named if sq is not None), None)
            out.append(self.found(
                other.tag, "divergence",
                f"at step {step}, {other.tag.who} recorded {_say(b)} where {ref.tag.who} recorded {_say(a)} "
                f"(decision {i + 1} of the step; {len(theirs)} against {len(mine)} decisions)",
                step=step, block=block, seq=seq, other_trace=ref.tag.name,
                theirs=[list(d) for d in theirs[i:i + 8]], reference=[list(d) for d in mine[i:i + 8]]))
        return out

    def _decisions(self, rank: _Rank, rec: tuple | None) -> list[tuple]:
        """A closed step's decisions: kept in its record, or recorded again from the rank's trace."""
        if rec is None:
            return []
        if rec[4] is not None:
            return rec[4]
        key = (rank.tag.index, rec[1])
        if key in self._reread_steps:  # the reference rank of several that differ from it at one step
            return self._reread_steps[key]
        assert self.reread is not None, f"the decisions of {rank.tag.name} were not kept and cannot be read again"
        for records in self.reread(rank.tag):
            for again in records:
                if again[0] == _CLOSED and again[1] == rec[1] and again[2] == rec[2]:
                    self._reread_steps[key] = again[4]
                    return again[4]
        raise AssertionError(f"step {rec[1]} of {rank.tag.name} read again differs from its first reading")


def _expected_ranks(h: Header) -> int:
    """How many rank traces one engine writes, as its header says (1 where it says no sizes)."""
    return (h.tp_size or 1) * (h.pp_size or 1)


def _digest_of(rec: tuple | None) -> bytes | None:
    return rec[2] if rec is not None else None


def _facts(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


def _span(layers: list[int]) -> str:
    s = sorted(layers)
    return f"{s[0]}-{s[-1]}" if s == list(range(s[0], s[-1] + 1)) and len(s) > 1 else ", ".join(map(str, s))
