"""Adapters: a prefix-cache hit on K/V another adapter computed.

A LoRA changes K and V at every layer it adapts, so which adapter computed a block is part of what the block
holds, exactly like its tokens. Engines key their prefix caches by the adapter's *name* (vLLM adds the path):
- two adapters registered under one name with different ids share blocks (vllm #30931);
- an adapter reloaded in place under the same name and path (the RL LoRA sync, ``load_inplace``) hits K/V of
  its previous contents (vllm PR #42495, #42125; ms-swift resets the cache after a LoRA-only sync for this);
- key parts appended untagged let a cache salt equal to an adapter's name (vllm #44701), or a crafted extra key
  equal to an adapter's id (sglang #24638), reach that adapter's blocks from the base model.
A block remembers the adapter identity of its first write since allocation: the name and id its writer runs
under (``seq_start``) and the load number (and contents' digest) the latest ``adapter`` event gave that id;
two identities with one name and the same digest compute the same K/V, whatever their ids. A hit (``share`` with a
``hash``) by a sequence of another identity is an error; when the two sides' key parts (``seq_start``'s
salt, extra keys, adapter name and id) read the same once joined untagged, in either order engines join them
(vLLM: adapter name, extra keys, salt; sglang: salt, extra key, adapter id), the cause is the key's untagged
parts, and the rule says so. A request that
reads its own blocks computed before its adapter was reloaded with other contents (it ran across the reload)
mixes two adapters' K/V: a warning, as ``weights/stale-read`` is for a weights update.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..events import PREFIX_CACHE, Adapter, Evict, Free, Read, SeqEnd, SeqStart, Share, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["AdaptersCheck"]

# (name, id, load, digest of its contents when the producer gave one) of the adapter a block was computed
# under; None for the base model alone
Identity = tuple[str, Any, int, str | None] | None


def _same(a: Identity, b: Identity) -> bool:
    """Whether K/V computed under ``a`` and ``b`` are the same: one name and, where both contents are known, the
    same contents (a server re-adding an adapter under a new id computes the same K/V), else the same id and load."""
    if a is None or b is None:
        return a is b
    if a[0] != b[0]:
        return False
    if a[3] is not None and b[3] is not None:
        return a[3] == b[3]
    return a[1:3] == b[1:3]


def _describe(identity: Identity) -> str:
    if identity is None:
        return "the base model (no adapter)"
    name, key, load, _ = identity
    return f"adapter {name!r} (id {key}, load {load})"


class AdaptersCheck(CheckBase):
    name = "adapters"
    RULES = (
        Rule("foreign-hit", "error",
             "a prefix-cache hit took a block computed under another adapter identity (name, id or load) than the "
             "hitting sequence runs under"),
        Rule("key-collision", "error",
             "a prefix-cache hit across adapter identities whose key parts coincide untagged: a cache salt equal to "
             "an adapter's name, an extra key equal to an adapter's id"),
        Rule("stale-read", "warning",
             "a request read K/V it computed under its adapter's previous contents: the adapter was reloaded with "
             "other contents while the request ran"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self.loads: dict[Any, tuple[int, Adapter]] = {}  # adapter id -> (its load number, the event that set it)
        self.seqs: dict[Any, SeqStart] = {}  # live sequences that run under an adapter or carry a salt
        self.written_under: dict[int, tuple[Identity, Any]] = {}  # block -> (identity, writer) of its first write
        self.keyed_by: dict[int, SeqStart] = {}  # block -> its first writer's key parts (it may have ended since)
        self._hits: dict[Any, list[int]] = {}  # seq -> foreign blocks it hit (evidence of its one finding)

    def handlers(self):
        return {Adapter: self._adapter, SeqStart: self._start, SeqEnd: self._end, Write: self._write,
                Share: self._share, Free: self._gone, Evict: self._gone, Read: self._read}

    def _adapter(self, ev: Adapter) -> Sequence[Finding]:
        self.loads[ev.adapter_id] = (ev.load, ev)
        return NO_FINDINGS

    def _start(self, ev: SeqStart) -> Sequence[Finding]:
        if ev.adapter is not None or ev.adapter_id is not None or ev.salt is not None or ev.extra_keys:
            self.seqs[ev.seq] = ev
        return NO_FINDINGS

    def _end(self, ev: SeqEnd) -> Sequence[Finding]:
        self.seqs.pop(ev.seq, None)
        self._hits.pop(ev.seq, None)  # its finding keeps the list
        return NO_FINDINGS

    def _identity(self, seq: Any) -> Identity:
        start = self.seqs.get(seq)
        if start is None or (start.adapter is None and start.adapter_id is None):
            return None
        key = start.adapter_id if start.adapter_id is not None else start.adapter
        load = self.loads.get(key)
        return (start.adapter or str(key), key, load[0] if load else 0, load[1].digest if load else None)

    def _write(self, ev: Write) -> Sequence[Finding]:
        if ev.block not in self.written_under:
            self.written_under[ev.block] = (self._identity(ev.seq), ev.seq)
            if ev.seq in self.seqs:
                self.keyed_by[ev.block] = self.seqs[ev.seq]
        return NO_FINDINGS

    def _gone(self, ev: Free | Evict) -> Sequence[Finding]:
        self.written_under.pop(ev.block, None)
        self.keyed_by.pop(ev.block, None)
        return NO_FINDINGS

    def _read(self, ev: Read) -> Sequence[Finding]:
        mine = self._identity(ev.seq)
        if mine is None or ev.seq in self._hits:
            return NO_FINDINGS  # no adapter; or its foreign hit is the cause
        under = self.written_under
        old = [b for b in ev.blocks if (theirs := under.get(b, (None,))[0]) is not None
               and theirs[:2] == mine[:2] and not _same(theirs, mine)]
        if not old or not self.once("stale-read", ev.seq, mine[2]):
            return NO_FINDINGS
        theirs = under[old[0]][0]
        return [self.finding(
            "stale-read",
            f"request {ev.seq!r} read {len(old)} block(s) ({', '.join(map(str, old[:8]))}) at step {ev.step} computed "
            f"under {_describe(theirs)}, but its adapter was reloaded since with other contents (load {theirs[2]} -> "
            f"{mine[2]}): its K/V mix two adapters. Finish or restart requests across an adapter reload",
            seq=ev.seq, block=old[0], step=ev.step, layer=ev.layer, stale_blocks=old,
            computed_under=_identity_dict(theirs), reads_under=_identity_dict(mine),
            events=[self.event_dict(a) for a in self._load_events(mine)],
        )]

    def _share(self, ev: Share) -> Sequence[Finding]:
        if ev.hash is None or ev.seq == PREFIX_CACHE or ev.block not in self.written_under:
            return NO_FINDINGS
        theirs, writer = self.written_under[ev.block]
        mine = self._identity(ev.seq)
        if _same(mine, theirs):
            return NO_FINDINGS
        hits = self._hits.get(ev.seq)
        if hits is not None:  # the same request's next foreign block: evidence of its one finding
            hits.append(ev.block)
            return NO_FINDINGS
        hits = self._hits[ev.seq] = [ev.block]
        collision = self._collision(ev.seq, writer, self.keyed_by.get(ev.block))
        rule = "key-collision" if collision else "foreign-hit"
        cause = collision or self._cause(mine, theirs)
        return [self.finding(
            rule,
            f"prefix hit on block {ev.block} by request {ev.seq!r} at step {ev.step}: the block was computed by "
            f"{writer!r} under {_describe(theirs)}, but {ev.seq!r} runs under {_describe(mine)}; {cause}. Its K/V "
            f"are another model's (evidence.foreign_blocks lists every such block the request hit)",
            seq=ev.seq, block=ev.block, step=ev.step, computed_under=_identity_dict(theirs),
            hit_under=_identity_dict(mine), written_by=writer, foreign_blocks=hits,
            events=[self.event_dict(ev)] + [self.event_dict(a) for a in self._load_events(mine, theirs)],
            history=self.ledger.block_history(ev.block),
        )]

    def _load_events(self, *identities: Identity) -> list[Adapter]:
        keys = {i[1] for i in identities if i is not None}
        return [self.loads[k][1] for k in keys if k in self.loads]

    def _collision(self, seq: Any, writer: Any, keyed: SeqStart | None) -> str | None:
        """The cause when the hitting request's key parts and those of the block's writer (``keyed``) read the same
        joined untagged, else None."""
        for order, report in ((_VLLM_ORDER, "vllm #44701"), (_SGLANG_ORDER, "sglang #24638")):
            ours, other = _parts(self.seqs.get(seq), order), _parts(keyed, order)
            if ours != other and "".join(v for _, v in ours) == "".join(v for _, v in other):
                return (f"their prefix-key parts differ ({_tagged(ours) or 'none'} for {seq!r}, {_tagged(other) or 'none'} "
                        f"for {writer!r}) but read the same joined untagged: the engine's prefix key does not keep its "
                        f"parts apart (tag each part: {report})")
        return None

    @staticmethod
    def _cause(mine: Identity, theirs: Identity) -> str:
        if mine is None or theirs is None:
            return "the prefix key leaves the adapter out (vllm #3264)"
        if mine[:2] == theirs[:2]:
            return (f"adapter {mine[0]!r} was reloaded in place with other contents (load {theirs[2]} -> {mine[2]}) "
                    f"and the prefix cache was not reset: the key holds its name and path, not its load (vllm PR "
                    f"#42495). Reset the prefix cache after reloading an adapter")
        if mine[0] == theirs[0]:
            return (f"two adapters share the name {mine[0]!r} (ids {theirs[1]} and {mine[1]}): the key holds the "
                    f"name, not the id (vllm #30931)")
        return "the prefix key does not tell these adapters apart"


_VLLM_ORDER = ("adapter", "extra_keys", "salt")  # the order engines join a request's key parts in
_SGLANG_ORDER = ("salt", "extra_keys", "adapter_id")


def _parts(start: SeqStart | None, order: tuple[str, ...]) -> list[tuple[str, str]]:
    """``start``'s prefix-key parts, tagged, in ``order``: (tag, value) for each part it has."""
    if start is None:
        return []
    out: list[tuple[str, str]] = []
    for tag in order:
        value = getattr(start, tag)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v != "":
                out.append((tag, str(v)))
    return out


def _tagged(parts: list[tuple[str, str]]) -> str:
    return ", ".join(f"{tag}={value!r}" for tag, value in parts)


def _identity_dict(identity: Identity) -> dict | None:
    if identity is None:
        return None
    name, key, load, digest = identity
    return {"name": name, "id": key, "load": load, "digest": digest}
