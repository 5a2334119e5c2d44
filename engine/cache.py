"""``PagedKVCache``: the engine's KV cache as the model runner sees it.

The runner's step is: ``reserve`` slots for each sequence's new tokens, ``store``
every layer's K/V into them (``gather`` the sequence's K/V for attention in
between), ``commit`` once all layers are stored, ``emit_read`` for what attention
read, and ``end_step``. Under memory pressure the cache demotes other sequences'
blocks to slower tiers (and, only when every tier is full, evicts), brings a
sequence's blocks back up when it is used again, and records every state change
as a v1 event on ``cache.bus``.

Sequences used in the current step (reserved, gathered or made resident) are
pinned until ``end_step``: their blocks are never chosen as victims, so a slot
handed out by ``reserve`` stays valid for the whole step.

Codecs: each block carries its codec (``Block.codec``) and lives in its tier's
arena of that codec (``storage.TierArenas``). Device blocks of other codecs than
the device's own (swapped back up from a lossier tier, or demoted by mixed
resolution) are read through ``read_blocks``, which decodes each block with its
codec; while every device block is in the device's own arena, reads and stores
take the single-codec path they always took. Under ``codec="mixed"`` a block that
leaves its sequence's recent window, is not a sink and is not among the blocks
with the most attention mass is re-encoded in place to ``mixed_low`` at commit
(a ``recode`` event), and never promoted back.

With ``KVDOCTOR_TRACE=/path/run.kvtrace`` set, every cache writes a trace of its own: the
process's first to that path, the 2nd, 3rd … to ``run.2.kvtrace``, ``run.3.kvtrace`` … beside it.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.metadata
import os
import threading
from typing import Any, Callable, Iterable, NamedTuple, Sequence as Seq

import numpy as np
import torch

from ..events import (PREFIX_CACHE, Evict, Header, Merge, PrefetchUse, Read, Recode, Rollback, SeqEnd, SeqStart,
                      Stage, TierSpec, Usage, Write)
from .bus import Bus
from .codecs import PRECISION, make_codec
from .config import EngineConfig, Tier
from .digest import DigestBook
from .errors import OutOfBlocks, UnknownSequence
from .faults import Faults, resolve_fault
from .merge import SlotCounts, merge_rows
from .policy import IMPORTANCE_DECAY, make_policy
from .pool import Block, BlockPool, Sequence
from .prefix import PrefixCache
from .readplan import BlockLoc, ReadPlan, plan_reads
from .staging import StagingArea
from .storage import Arena, TensorArena, TierArenas
from .tiers import TierManager

__all__ = ["PagedKVCache", "TRACE_ENV", "HOOKS_GROUP", "trace_path"]

TRACE_ENV = "KVDOCTOR_TRACE"
# Entry points called with the cache when a trace is switched on by TRACE_ENV: consumers that
# must run inside the workload (kvdoctor's memory probes) attach so, as the engine may not import them.
HOOKS_GROUP = "kvdoctor.engine_hooks"

class _StorePlan(NamedTuple):
    """Where one step's reserved slots are written (see ``PagedKVCache._plan_store``)."""

    blk: torch.Tensor  # (N,) device slot of each token's block
    off: torch.Tensor  # (N,) its position in the block
    rows: torch.Tensor | None  # (2 * N * H,) rows of D elements in a layer's arena; None: index by blk/off
    extent: int  # rows in a layer's arena view


_traced: dict[str, int] = {}  # absolute trace path -> caches of this process that traced to it
_traced_lock = threading.Lock()


def trace_path(path: str) -> str:
    """The file a cache switched on by ``KVDOCTOR_TRACE=path`` writes: ``path`` itself for the
    process's first cache, then ``<stem>.2.kvtrace``, ``<stem>.3.kvtrace`` … beside it for the
    2nd, 3rd … (closed or not), so several caches in one process never clobber each other's trace."""
    with _traced_lock:
        n = _traced[os.path.abspath(path)] = _traced.get(os.path.abspath(path), 0) + 1
    if n == 1:
        return path
    head, name = os.path.split(path)
    stem, dot, rest = name.partition(".kvtrace")
    if not dot:
        stem, rest = os.path.splitext(name)
    return os.path.join(head, f"{stem}.{n}{dot}{rest}")


class PagedKVCache:
    def __init__(self, config: EngineConfig, bus: Bus | None = None) -> None:
        self.config = config
        self.bus = bus if bus is not None else Bus()
        self.faults = Faults(resolve_fault(config.fault), config.num_layers)
        self.block_size = config.block_size
        self.codecs = {c: make_codec(c, config.block_size, config.head_dim, config.dtype, config.calibration)
                       for c in config.block_codecs}
        self.codec = self.codecs[config.tier_codec(Tier.DEVICE)]  # the device's own: new blocks are stored in it
        if self.faults.content == "wrong-scale" and self.codec.native:
            raise ValueError(f"the wrong-scale fault needs a quantized device codec (int8 or nf4), not {self.codec.name}")
        self.digests = DigestBook(config, self.codecs)
        self._stale_bytes: tuple[Block, torch.Tensor] | None = None  # stale-slot fault: the bytes a write must not replace
        self._closed = True  # until every arena exists, close() has nothing to undo
        self.tier_arenas: dict[str, TierArenas] = {}
        try:
            for t in config.tiers:
                self.tier_arenas[t] = TierArenas(t, config)
        except BaseException:
            for a in self.tier_arenas.values():
                a.close()
            raise
        self._closed = False
        self.arenas: dict[str, Arena] = {t: a.primary for t, a in self.tier_arenas.items()}  # each tier's own codec
        self._devs = self.tier_arenas[Tier.DEVICE]
        self._dev: TensorArena = self.arenas[Tier.DEVICE]  # type: ignore[assignment]
        self.device = self._dev.device
        self.pool = BlockPool(config, self.bus, {t: self._grower(t) for t in config.tiers})
        self._dev_slots = self.pool.tiers[Tier.DEVICE]
        self.seqs: dict[Any, Sequence] = {}
        self._tick = 0
        self.peak_kv_bytes = 0  # the most KV bytes resident (every tier, each block in its codec) at a step's end
        self.num_recodes = 0  # blocks re-encoded in place (mixed resolution's demotions)
        self._pinned: set[Any] = set()  # sequences the current step uses
        self._reserved: list[Any] = []  # sequences in the order this step reserved them
        # long context: the blocks this step needs on the device (sinks, recent windows, blocks written); the
        # rest of a running sequence's blocks may be demoted, and attention streams them (engine.streaming)
        self._held: set[int] = set()
        self.staging = (StagingArea(config, self.tier_arenas, self.codecs, self.device, by_id=self.faults.stale_staging)
                        if config.long_context else None)
        self.bytes_staged = 0  # long context: bytes the staging area moved, every step so far
        self.rows_from_device = 0  # long context: (layer, block) reads served by a copy already on the device
        self.rows_from_slower = 0  # ... and those that had to be copied up from a slower tier
        self._kv: list[torch.Tensor] | None = None  # per-layer views of the device arena
        self._store_plan: tuple[torch.Tensor, _StorePlan] | None = None  # the last ``slots`` stored and its plan
        self.tiers = TierManager(
            config, self.pool, self.tier_arenas, self.bus, make_policy(config), self.faults, self.codecs,
            protected=self._is_protected, evictable=self._is_evictable, evict=self._evict,
            distance=self._distance, clock=lambda: self._tick, digests=self.digests, reclaim=self._reclaim_cached,
        )
        self.prefix: PrefixCache | None = None
        if config.prefix_cache:
            kv = {"codec": "mixed" if config.mixed else config.tier_codec(Tier.DEVICE), "dtype": config.dtype}
            self.prefix = PrefixCache(self.pool, self.block_size, {**config.prefix_salt, **kv}, self.faults)
        self._writer: Any = None
        self._attached: list[Any] = []  # what the hooks attached; each has detach()
        trace = os.environ.get(TRACE_ENV)
        if trace:
            self._open_trace(trace)

    # ---- tracing ----
    def _open_trace(self, path: str) -> None:
        from ..trace import TraceWriter

        self._writer = TraceWriter(trace_path(path), self.header())
        self.bus.subscribe(self._writer.write_many)
        atexit.register(self.close)
        for hook in importlib.metadata.entry_points(group=HOOKS_GROUP):
            attached = hook.load()(self)
            if attached is not None:
                self._attached.append(attached)

    def header(self) -> Header:
        c = self.config
        return Header(
            block_size=c.block_size,
            num_layers=c.num_layers,
            tiers=[TierSpec(name=t, capacity_blocks=c.capacity(t),
                            codec="mixed" if c.mixed and t == Tier.DEVICE else c.tier_codec(t),
                            io=self.arenas[t].io if t == Tier.DISK else None) for t in c.tiers],
            model=c.extra.get("model"),
            engine="kvdoctor.engine",
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            pid=os.getpid(),
            calibration=f"{c.calibration.source} (digest {c.calibration.digest})" if c.calibration else None,
        )

    # ---- helpers the tier manager calls back ----
    def _grower(self, tier: str):
        arenas = self.tier_arenas[tier]

        def grow(index: int) -> range:
            self.tiers.drain()  # a reallocating arena must not have copies landing in the old tensor
            new = arenas.get(index).grow()
            if tier == Tier.DEVICE and index == 0:
                self._kv = None
                self._store_plan = None
            return new

        return grow

    def _is_protected(self, b: Block) -> bool:
        if self.staging is not None:  # long context: a running sequence needs only these on the device
            return b.id in self._held
        return any(o in self._pinned for o in b.owners)

    def _is_evictable(self, b: Block) -> bool:
        # a sequence's newest block is never evicted: its next token is written there
        return all(self.seqs[o].blocks[-1] is not b for o in b.owners if o in self.seqs)

    def _distance(self, b: Block) -> float:
        s = self.seqs.get(b.owners[0])
        if s is None:
            return 1.0
        end = max(s.length + s.pending, 1)
        return min(max(end - b.index * self.block_size, 0) / end, 1.0)

    def _evict(self, victims: list[Block], tier: str, reason: str = "capacity") -> None:
        for b in victims:
            if self.prefix is not None:
                self.prefix.forget(b)
            for o in b.owners:
                s = self.seqs.get(o)
                if s is not None:
                    s.blocks.remove(b)
                    s.index_cache = None
            if self.bus.enabled:
                self.bus.emit(Evict, block=b.id, tier=tier, reason=reason)
            self.pool.drop(b)

    def _seq(self, seq: Any) -> Sequence:
        try:
            return self.seqs[seq]
        except KeyError:
            raise UnknownSequence(seq) from None

    def _layer_kv(self, layer: int) -> torch.Tensor:
        if self._kv is None:
            self._kv = [self._dev.layer_kv(layer_) for layer_ in range(self.config.num_layers)]
        return self._kv[layer]

    def _free_or_keep(self, b: Block, seq: Any, *, emit_release: bool) -> None:
        """``seq`` lets go of ``b``; the block is freed if nobody else owns it."""
        if self.pool.blocks.get(b.id) is not b:
            return  # only the prefix-freed-in-use fault gets here: the cache dropped the block under its reader
        self.tiers.try_settle(b)  # the block is being dropped anyway: a bad copy of it is simply discarded
        if self.pool.release(b, seq, emit=emit_release):
            self.pool.free(b)

    # ---- prefix cache (engine.prefix) ----
    def _reclaim_cached(self, tier: str, need: int, exclude: set[int]) -> None:
        """Room in ``tier`` from the prefix cache first: its least recently used blocks that no request holds
        move one tier down while that tier has free slots, and are evicted (reason ``prefix-cache``) past
        that, so keeping a cached block never pushes a request's block down."""
        if self.prefix is None or need <= 0:
            return
        victims = self.prefix.idle(tier, exclude)[:need]
        if not victims:
            return
        nxt = self.tiers.slower(tier)
        room = self.pool.tiers[nxt].num_free if nxt is not None else 0
        if room:
            self.tiers.move(victims[:room], nxt)
        if victims[room:]:
            self._evict(victims[room:], tier, reason=PREFIX_CACHE)

    def reclaimable(self, tier: str) -> int:
        """Slots of ``tier`` the prefix cache gives up when room is needed (its blocks no request holds)."""
        return len(self.prefix.idle(tier)) if self.prefix is not None else 0

    def reuse_prefix(self, seq: Any, tokens: Seq[int]) -> int:
        """Start ``seq`` (empty, just added) from the longest cached prefix of ``tokens``: the cached blocks
        become its first blocks (a ``share`` with the content key each). Returns the tokens served, which
        ``seq`` need not compute; 0 without a prefix cache."""
        s = self._seq(seq)
        if self.prefix is None:
            return 0
        if s.length or s.pending or s.blocks:
            raise ValueError(f"reuse_prefix for {seq!r}: it already holds {s.length + s.pending} tokens")
        hits = self.prefix.lookup(seq, tokens)
        if hits:
            self._tick += 1
            self._pinned.add(seq)  # its hits stay where they are until the step that computes the rest
            for b in hits:
                b.last_access = self._tick
            s.blocks = list(hits)
            s.length = len(hits) * self.block_size
            s.last_access = self._tick
            s.index_cache = None
        return s.length

    def _reuse_cached_block(self, seq: Any, index: int) -> Block | None:
        """prefix-overwritten: an idle cached block handed out as ``seq``'s new block, still in the cache."""
        idle = self.prefix.idle(Tier.DEVICE) if self.prefix is not None else []
        if not idle:
            return None
        b = min(idle, key=lambda b: b.id)  # the faulty allocator takes blocks lowest id first, cached or not
        self.pool.share(b, seq)
        b.index, b.checksum, b.last_access = index, None, self._tick
        self.faults.fired(b.id, seq, None, self.bus.step)
        return b

    def _drop_cached_under_readers(self, s: Sequence) -> None:
        """prefix-freed-in-use: the blocks ``s`` registered are evicted as it ends, whoever still holds them."""
        for b in s.blocks:
            if self.prefix.registered_by(b) != s.id or self.pool.blocks.get(b.id) is not b:
                continue
            if b.inflight is not None:
                self.tiers.settle(b)
            self.prefix.forget(b)
            if any(o in self.seqs for o in b.owners):
                self.faults.fired(b.id, next(o for o in b.owners if o in self.seqs), None, self.bus.step)
            if self.bus.enabled:
                self.bus.emit(Evict, block=b.id, tier=b.tier, reason=PREFIX_CACHE)
            self.pool.drop(b)

    # ---- sequences ----
    def add_sequence(self, seq: Any, prompt_len: int = 0, priority: int = 0, adapter: str | None = None) -> None:
        """A new sequence; ``adapter``: what the request runs under besides the model (a LoRA's name), part
        of the prefix cache's salt, so requests under different adapters never share blocks."""
        if seq in self.seqs:
            raise ValueError(f"sequence {seq!r} is already in the cache")
        self.seqs[seq] = Sequence(seq, prompt_len, priority)
        if self.bus.enabled:
            self.bus.emit(SeqStart, seq=seq, prompt_len=prompt_len)
        if self.prefix is not None:
            self.prefix.begin(seq, adapter)

    def remove_sequence(self, seq: Any, reason: str = "finished", error: str | None = None) -> None:
        """The sequence leaves: every block it owns is released, and freed when no one else owns it.
        ``error``: the name of the typed error the engine failed it with (``reason`` is then "aborted")."""
        s = self._seq(seq)
        del self.seqs[seq]
        self._pinned.discard(seq)
        if self.bus.enabled:
            self.bus.emit(SeqEnd, seq=seq, reason=reason, error=error)
        if self.prefix is not None:
            if self.faults.prefix_freed_in_use:
                self._drop_cached_under_readers(s)
            self.prefix.ended(seq)
        for b in reversed(s.blocks):
            if self.faults.leak_swapped and b.tier != Tier.DEVICE:
                continue  # the fault: a block away from the device is forgotten, owner and all
            self._free_or_keep(b, seq, emit_release=False)

    def fork(self, parent: Any, child: Any) -> None:
        """``child`` starts as a copy of ``parent``'s committed tokens, sharing its blocks."""
        p = self._seq(parent)
        if p.pending:
            raise ValueError(f"fork of {parent!r} with {p.pending} reserved tokens not committed")
        self.add_sequence(child, prompt_len=p.length, priority=p.priority)
        if self.prefix is not None:
            self.prefix.forked(parent, child)
        c = self.seqs[child]
        c.length = p.length
        c.blocks = list(p.blocks)
        for b in c.blocks:
            self.pool.share(b, child)

    def adopt(self, seq: Any, source: Any) -> None:
        """``seq`` gives up its own tokens and takes ``source``'s committed ones, keeping its id (beam
        search's reorder: the hypothesis in a row is replaced by another row's).

        Ownership changes hands and no K/V is copied: ``seq`` shares every block of ``source`` it does
        not hold yet and releases every block of its own that ``source`` does not hold (freed when
        ``seq`` was its last owner). A later write into a shared partial block copies it first
        (``reserve``), so ``source`` never sees ``seq``'s tokens. Both must hold the same number of
        tokens: the events tell a sequence's length only through its writes, so a ``seq`` that took
        another length would look misplaced to the checks (``fork`` a new sequence instead)."""
        s, src = self._seq(seq), self._seq(source)
        if s is src:
            return
        if s.pending or src.pending:
            raise ValueError(f"adopt of {source!r} by {seq!r} with reserved tokens not committed "
                             f"({src.pending} and {s.pending})")
        if s.length != src.length:
            raise ValueError(f"adopt of {source!r} ({src.length} tokens) by {seq!r} ({s.length} tokens): "
                             "the lengths must match; fork a new sequence instead")
        held = {b.id for b in s.blocks}
        for b in src.blocks:
            if b.id not in held:
                self.pool.share(b, seq)  # before the releases: a block both hold never loses its last owner
        kept = {b.id for b in src.blocks}
        old, s.blocks = s.blocks, list(src.blocks)
        s.index_cache = None
        for b in reversed(old):
            if b.id not in kept:
                self._free_or_keep(b, seq, emit_release=True)

    def seq_len(self, seq: Any) -> int:
        return self._seq(seq).length

    def version(self, seq: Any) -> int:
        return self._seq(seq).version

    def block_table(self, seq: Any) -> list[int]:
        return [b.id for b in self._seq(seq).blocks]

    def slot_counts(self, seq: Any) -> list[SlotCounts | None]:
        """Token merging: what it left in each of ``seq``'s blocks (position order; None: never looked at)."""
        return [b.merged for b in self._seq(seq).blocks]

    # ---- writing ----
    def reserve(self, seq: Any, n: int) -> torch.Tensor:
        """Device slots for ``seq``'s next ``n`` positions, as a ``(n,)`` LongTensor.

        Allocates the blocks those positions need (demoting other sequences' blocks if
        the device is full), brings the block being appended to back to the device, and
        gives the sequence its own copy of that block if it is shared.
        """
        s = self._seq(seq)
        if n < 0:
            raise ValueError(f"reserve of {n} tokens for {seq!r}: must be >= 0")
        bs = self.block_size
        self._tick += 1
        s.last_access = self._tick
        self._pinned.add(seq)
        if seq not in self._reserved:
            self._reserved.append(seq)
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=self.device)
        start = s.length + s.pending
        end = start + n
        last = s.blocks[-1] if s.blocks else None
        tail = last if last is not None and last.index == start // bs else None
        if tail is not None and tail.inflight is not None:
            self.tiers.settle(tail)  # a prefetch already holds its device slot: land it rather than ask for another
        cow = tail is not None and len(tail.owners) > 1
        first_new = (last.index + 1) if last is not None else 0
        num_new = max((end - 1) // bs + 1 - first_new, 0)
        need = num_new + int(cow) + int(tail is not None and tail.tier != Tier.DEVICE)
        keep = {b.id for b in s.blocks} if self.staging is None else self._hold(s, tail)
        self.tiers.make_room(Tier.DEVICE, need, keep)
        if tail is not None:
            if tail.tier != Tier.DEVICE:
                self.tiers.move([tail], Tier.DEVICE, exclude=keep)
            if cow:
                tail = self._copy_on_write(s, tail, start)
            tail.checksum = None  # its bytes are about to change
        for i in range(first_new, first_new + num_new):
            reused = self._reuse_cached_block(seq, i) if self.faults.prefix_overwritten else None
            s.blocks.append(reused or self.pool.alloc(Tier.DEVICE, seq, i))
            self._held.add(s.blocks[-1].id)
            if self.faults.content == "stale-slot":
                self._stale_slot(s.blocks[-1], seq)
        s.index_cache = None
        writes: list[tuple[Block, int, int]] = []
        slots: list[int] = []
        by_index = {b.index: b for b in s.blocks[-(num_new + 1):]}
        misaligned = self._misaligned_target(seq, n)
        pos = start
        while pos < end:
            b = misaligned or by_index[pos // bs]
            m = min(end, (pos // bs + 1) * bs) - pos
            off = pos % bs
            slots.extend(range(b.slot * bs + off, b.slot * bs + off + m))
            writes.append((b, pos, m))
            b.last_access = self._tick
            pos += m
        s.writes.extend(writes)
        s.pending += n
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _hold(self, s: Sequence, tail: Block | None) -> set[int]:
        """Long context: keep ``s``'s sinks, recent window and the block being appended to on the device this step."""
        c = self.config
        held = {b.id for b in s.blocks[: c.sink_blocks]} | {b.id for b in s.blocks[-c.local_blocks :]}
        if tail is not None:
            held.add(tail.id)
        self._held |= held
        return set(self._held)

    def max_step_tokens(self, seq: Any) -> int | None:
        """Long context: the most new tokens ``seq`` may reserve in one step (a prompt longer than the device is
        prefilled in chunks this size): the blocks they touch, its sinks and its window fit the device. None: no limit."""
        if self.staging is None:
            return None
        s = self.seqs.get(seq)
        start = s.length + s.pending if s is not None else 0
        room = self.pool.tiers[Tier.DEVICE].capacity - self.config.pinned_blocks
        return max(room * self.block_size - start % self.block_size, 1)

    def _misaligned_target(self, seq: Any, n: int) -> Block | None:
        """batch-misalign fault: the second row of a step writes into the first row's tail block."""
        if n != 1 or len(self._reserved) < 2 or self._reserved[1] != seq:
            return None
        first = self.seqs.get(self._reserved[0])
        if first is None or not first.blocks or first.blocks[-1].tier != Tier.DEVICE:
            return None
        return first.blocks[-1] if self.faults.misalign_now(self.bus.step) else None

    def _copy_on_write(self, s: Sequence, shared: Block, start: int) -> Block:
        """Give ``s`` a private copy of the shared block it is about to append to."""
        own = self.pool.alloc(Tier.DEVICE, s.id, shared.index, shared.codec)
        dst, d = self._devs.at(own.slot)
        src, s_ = self._devs.at(shared.slot)
        dst.view(d, 1).copy_(src.view(s_, 1))
        own.version = shared.version
        own.digest = shared.digest.copy() if shared.digest is not None else None
        own.merged = shared.merged
        own.last_access = self._tick
        s.blocks[-1] = own
        self._free_or_keep(shared, s.id, emit_release=True)
        return own

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` (each ``(N, H_kv, D)``) for one layer at ``slots`` from ``reserve``
        (encoded by the codec when it quantizes). While someone listens, what was meant for each slot is
        staged for the blocks' digests (``commit`` books it)."""
        meant = slots
        if self.faults.row_off_by_one:
            slots = self._row_off_by_one(layer, slots)
        plan = self._plan_store(slots)
        blk, off = plan.blk, plan.off
        digest = self.bus.enabled and self.digests.recording
        if self._dev_slots.used_by[0] != self._dev_slots.used:  # some device blocks are in other codecs' arenas
            self._store_mixed(layer, blk, off, k, v, meant if digest else None)
            return
        if not self.codec.native:
            parts = self.codec.write(self._dev.data[:, layer], layer, blk, off, k, v)
            if digest:
                self._stage(id(meant), layer, self.codec.name, meant, parts, 0)
            return
        kv = self._layer_kv(layer)  # (P, H, 2, bs, D)
        if plan.rows is not None:  # one copy of every head's K and V row into the arena as (rows, D)
            kv.as_strided((plan.extent, kv.shape[-1]), (kv.shape[-1], 1)).index_copy_(
                0, plan.rows, torch.stack((k, v)).to(kv.dtype).view(-1, kv.shape[-1]))
        else:
            kv[blk, :, 0, off] = k.to(kv.dtype)
            kv[blk, :, 1, off] = v.to(kv.dtype)
        if digest:
            self.digests.stage(id(meant), layer, self.codec.name, meant, (k, v))

    def store_rows(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Where ``store`` writes each token's K and V heads in every layer's device arena, seen from
        ``layer_kv(layer)``'s first element as rows of ``head_dim`` elements, ordered (K/V, token, head): for
        a caller that writes them itself (the compiled decode layers) and then calls ``stored``. None where
        a store must go through ``store``: codes, blocks in several codecs, a fault that moves rows."""
        if self.faults.row_off_by_one or not self.codec.native or self._dev_slots.used_by[0] != self._dev_slots.used:
            return None
        return self._plan_store(slots).rows

    def digest_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The digests' weights (of K and of V ``(H_kv, D)``, of a record's columns ``(L, U)``) while stores
        are recorded (someone listens), else None: a caller that writes K/V at ``store_rows`` itself sums
        each token's units and digest shares by them (digest.c, decode_layer.c)."""
        if not (self.bus.enabled and self.digests.recording):
            return None
        return self.digests.weights(self.codec.name)

    def stored(self, slots: torch.Tensor, units: np.ndarray, shares: np.ndarray | None = None) -> None:
        """What ``store`` does besides copying, for tokens a caller wrote at ``store_rows(slots)``: staging
        every layer's unit sums ``(L, N)`` of them, and their digest shares ``(N, U)``, taken by
        ``digest_weights``, for the blocks' digests."""
        if self.bus.enabled and self.digests.recording:
            self.digests.stage_units(id(slots), self.codec.name, slots, units, shares)

    def _plan_store(self, slots: torch.Tensor) -> _StorePlan:
        """Where ``slots`` lie: block and offset, and for the device arena's own layout the (K/V, token, head)
        rows of D elements each token's heads go to in a layer's arena seen as (rows, D). The same for every
        layer (they share strides), so a step's layers reuse the plan of the one ``slots`` tensor they store."""
        if self._store_plan is not None and self._store_plan[0] is slots:
            return self._store_plan[1]
        blk, off = slots // self.block_size, slots % self.block_size
        rows, extent = None, 0
        strides = self._row_strides() if self.codec.native else None
        if strides is not None:
            s_blk, s_head, s_kv, s_pos = strides
            kv = self._layer_kv(0)
            heads = torch.arange(kv.shape[1], device=slots.device)
            at = (blk * s_blk + off * s_pos)[:, None] + heads[None, :] * s_head  # (N, H) rows of K
            rows = torch.stack((at, at + s_kv)).view(-1)  # (2 * N * H,): K rows, then V rows
            extent = ((kv.shape[0] - 1) * s_blk + (kv.shape[1] - 1) * s_head + s_kv + (kv.shape[3] - 1) * s_pos) + 1
        plan = _StorePlan(blk, off, rows, extent)
        self._store_plan = (slots, plan)
        return plan

    def read_rows(self, table: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """Where in a layer's device arena each block's keys, and its values, of each head start, as element
        offsets from the layer's start, ordered (K/V, row, head, block), for ``table`` (B, blocks) of device
        slots; and the extent they index. A block's positions of one head are contiguous (D elements each),
        so one ``index_select`` a layer gathers K and V straight into attention's layout (B, H, T, D). The
        same for every layer; None where ``layer_kv`` is no view of the dtype (codes, several codecs)."""
        try:
            self.layer_kv(0)
        except ValueError:
            return None, 0
        strides = self._row_strides()
        if strides is None:
            return None, 0
        D = self.config.head_dim
        s_blk, s_head, s_kv, _ = (st * D for st in strides)
        heads = torch.arange(self.config.num_kv_heads, device=table.device)
        key = table[:, None, :] * s_blk + heads[None, :, None] * s_head  # (B, H_kv, nb)
        rows = torch.stack([key, key + s_kv]).reshape(-1)  # (2*B*H_kv*nb,)
        return rows, int(rows.max()) + 1

    def _row_strides(self) -> tuple[int, int, int, int] | None:
        """The device arena's strides in rows of D elements (block, head, K/V, position), the layout both the
        store plan and ``read_rows`` index; None where a layer's arena is not such rows."""
        kv = self._layer_kv(0)  # (P, H, 2, bs, D)
        D, strides = kv.shape[-1], kv.stride()
        if strides[-1] != 1 or strides[-2] != D or any(st % D for st in strides[:-1]):
            return None
        s_blk, s_head, s_kv, s_pos = (st // D for st in strides[:-1])
        return s_blk, s_head, s_kv, s_pos

    def _stage(self, key: Any, layer: int, codec: str, meant: torch.Tensor, parts: dict[str, torch.Tensor],
               base: int) -> None:
        """Stage what ``codec.write`` stored; its key groups are numbered in the arena, ``base`` its first slot."""
        groups = parts.pop("groups", None)
        if groups is not None:
            groups = groups + base * self.codecs[codec].key_groups
        self.digests.stage(key, layer, codec, meant, parts, groups)

    def _store_mixed(self, layer: int, blk: torch.Tensor, off: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meant: torch.Tensor | None) -> None:
        """``store`` when the device holds blocks in several codecs: each token encoded by its block's."""
        where = blk >> self._devs.shift
        for i in where.unique().tolist():
            sel = (where == i).nonzero().squeeze(1)
            arena = self._devs.get(i)
            local = blk[sel] & self._devs.mask
            parts = self.codecs[arena.codec].write(arena.data[:, layer], layer, local, off[sel], k[sel], v[sel])
            if meant is not None:
                self._stage((id(meant), i), layer, arena.codec, meant[sel], parts, self._devs.slot(i, 0))

    def commit(self, seq: Any, n: int | None = None, tokens: Seq[int] | None = None) -> None:
        """The first ``n`` reserved tokens (default: all) are stored in every layer: advance the
        version by ``n`` and emit a ``write`` per block touched. Reserved tokens beyond ``n`` are dropped.

        ``tokens``: their ids, which the prefix cache keys the blocks they fill by (without them, none of
        the sequence's blocks is cached from here on)."""
        s = self._seq(seq)
        n = s.pending if n is None else n
        if not 0 <= n <= s.pending:
            raise ValueError(f"commit of {n} tokens for {seq!r}: must be in [0, {s.pending}] (reserved)")
        left = n
        for b, pos, m in s.writes:
            if left <= 0:
                break
            m = min(m, left)
            left -= m
            s.version += m  # every write advances the version, so a stale copy shows up as an older one
            b.version = s.version
            b.checksum = None
            digest = None
            if self.bus.enabled and self.digests.recording:
                digest = self.digests.record_write(b, pos, m)
            else:
                b.digest = None  # its bytes changed unrecorded: nothing to verify them against from now on
            if self.bus.enabled:
                self.bus.emit(Write, block=b.id, seq=seq, pos=pos, n=m, version=s.version, digest=digest)
        if self.faults.content is not None:
            self._corrupt_after_write(s)
        s.length += n
        s.pending = 0
        s.writes = []
        if self.prefix is not None:
            self.prefix.committed(seq, s.blocks, tokens[:n] if tokens is not None else None)
        self._drop_tail(s, emit_release=True)
        if self.config.mixed:
            self._demote_unimportant(s)

    # ---- content faults (engine.faults): the bytes go wrong, the events stay right ----
    def _raw(self, b: Block) -> torch.Tensor:
        """``(L, H, R)`` view of a device block's stored row, in its arena's dtype."""
        arena, local = self._devs.at(b.slot)
        return arena.view(local, 1)[0]

    def _stale_slot(self, b: Block, seq: Any) -> None:
        """stale-slot: a block given a slot some earlier block used keeps that block's bytes (restored at commit)."""
        used = self.faults.used_slots
        if b.slot in used and self.faults.content_due(self.bus.step):
            self.faults.fired(b.id, seq, None, self.bus.step)
            self._stale_bytes = (b, self._raw(b).clone())
        used.add(b.slot)

    def _row_off_by_one(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """row-off-by-one: the step's first token that is not its block's last row lands one row further."""
        bs = self.block_size
        if layer == 0 and self.faults.content_due(self.bus.step):
            inner = ((slots % bs) < bs - 1).nonzero()
            if inner.numel():
                i = int(inner[0, 0])
                b, seq = next(((b, q) for q in self._reserved for b, _, _ in self.seqs[q].writes
                               if b.slot == int(slots[i]) // bs), (None, None))
                if b is not None:
                    self.faults.fired(b.id, seq, None, self.bus.step)
                    self.faults.shift = (int(slots[i]), self.bus.step)
        shift = self.faults.shift
        if shift is None or shift[1] != self.bus.step:
            return slots
        moved = slots.clone()
        moved[slots == shift[0]] += 1
        return moved

    def _corrupt_after_write(self, s: Sequence) -> None:
        """The content faults that strike right after ``s``'s write (see ``engine.faults``)."""
        f, step = self.faults, self.bus.step
        stale = self._stale_bytes
        if stale is not None and any(b is stale[0] for b, _, _ in s.writes):
            self._raw(stale[0]).copy_(stale[1])  # the write never landed: the previous block's bytes stay
            self._stale_bytes = None
        if not f.content_due(step) or not s.writes:
            return
        first, layer = s.blocks[0], f.corrupt_layer
        if f.content == "overwrite-foreign":
            other = next((q.blocks[-1] for q in self.seqs.values() if q is not s and q.blocks
                          and q.blocks[-1].tier == Tier.DEVICE and q.blocks[-1].codec == first.codec
                          and q.blocks[-1] not in s.blocks), None)
            if other is None or first.tier != Tier.DEVICE:
                return
            self._raw(first).copy_(self._raw(other))
            f.fired(first.id, s.id, None, step)
        elif f.content == "wrong-scale":
            b, pos, _ = s.writes[-1]
            codec = self.codecs[b.codec]
            if codec.native:
                return
            codec.scales(self._raw(b)[layer])[:, pos % self.block_size] *= 2  # (H, width) of the token
            f.fired(b.id, s.id, layer, step)
        elif f.content == "bit-flip":
            if first.tier != Tier.DEVICE:
                return
            row = self._raw(first)[layer, 0].view(torch.uint8)  # (R bytes) of head 0
            row[self._raw(first).element_size() - 1] ^= 0x40  # a high bit of element 0: exponent, or a code bit
            f.fired(first.id, s.id, layer, step)

    # ---- mixed resolution ----
    def _demote_unimportant(self, s: Sequence) -> None:
        """Mixed resolution: re-encode to ``mixed_low`` the device blocks of ``s`` that left its recent
        window, are not sinks, and are not among the ``keep`` with the most attention mass."""
        c = self.config
        old = s.blocks[: max(len(s.blocks) - c.mixed_window, 0)]
        high = self.codec.name
        cands = [b for b in old if b.codec == high and b.index >= c.sink_blocks]
        keep = max(c.mixed_high_blocks, int(c.mixed_high_fraction * len(s.blocks)))
        if len(cands) <= keep:
            return
        cands = [b for b in cands if b.tier == Tier.DEVICE and b.inflight is None and not self._in_a_window(b)]
        cands.sort(key=lambda b: b.importance, reverse=True)  # stable: among equals, the older blocks stay high
        if len(cands) > keep:
            self.recode([b.id for b in cands[keep:]], c.mixed_low)

    def _in_a_window(self, b: Block) -> bool:
        """A shared block stays high while it is in any owner's recent window."""
        w = self.config.mixed_window
        return len(b.owners) > 1 and any(b in self.seqs[o].blocks[-w:] for o in b.owners if o in self.seqs)

    def recode(self, blocks: Iterable[int], codec: str) -> None:
        """Re-encode device blocks in place to the lossier ``codec`` (a ``recode`` event each; the version
        stays). A block already at least as lossy is left as it is: precision never goes back up."""
        if codec not in self._devs.codecs:
            raise ValueError(f"recode to {codec!r}: the device holds {', '.join(self._devs.codecs)}")
        todo: dict[str, list[Block]] = {}
        for b in self._blocks(blocks):
            if b.tier != Tier.DEVICE or b.inflight is not None:
                raise ValueError(f"recode of block {b.id}: it is not settled on the device (tier {b.tier})")
            if PRECISION[codec] > PRECISION[b.codec]:
                todo.setdefault(b.codec, []).append(b)
        index = self._devs.index(codec)
        for src, group in todo.items():
            slots = self.tiers._take(Tier.DEVICE, [index] * len(group))
            before, bad = self.tiers.verify(group)  # the bytes about to be re-encoded, against their record
            sums = self.tiers.recode(Tier.DEVICE, [b.slot for b in group], src, Tier.DEVICE, slots, codec)
            for b, slot, c in zip(group, slots, sums):
                b.codec, b.checksum = codec, c
                self.pool.move(b, Tier.DEVICE, slot)  # the high slot goes back to its arena's free list
                self.num_recodes += 1
            after = self.tiers.retake(group)
            if self.bus.enabled:
                for b, d, layer, new in zip(group, before, bad, after):
                    self.bus.emit(Recode, block=b.id, tier=Tier.DEVICE, src_codec=src, dst_codec=codec,
                                  version=b.version, digest=d, digest_layer=layer, new_digest=new)

    # ---- token merging (engine.merge) ----
    def merge_tokens(self, blocks: Iterable[int], threshold: float) -> dict[int, int]:
        """Merge, in place, adjacent tokens of each block whose keys have at least ``threshold`` cosine similarity
        (per layer and KV head; see ``engine.merge``); a ``merge`` event for each block that shrank, its version
        unchanged. Only for settled device blocks of one owner: the others' readers expect every token. Returns
        the blocks that shrank, each with the (layer, head, slot) rows it gave up.

        Every block's rows are merged in one batch (the merge walks a block's positions one at a time, so a
        step's blocks share each step of the walk)."""
        c, bs = self.config, self.block_size
        L, H, D = c.num_layers, c.num_kv_heads, c.head_dim
        group = self._blocks(blocks)
        for b in group:
            if b.tier != Tier.DEVICE or b.inflight is not None or len(b.owners) != 1:
                raise ValueError(f"merge of block {b.id}: it must be settled on the device with one owner "
                                 f"(tier {b.tier}, owners {b.owners})")
        if not group:
            return {}
        n = len(group)
        slots = torch.tensor([b.slot for b in group], dtype=torch.long, device=self.device)
        k, v = zip(*(self.read_blocks(layer, slots) for layer in range(L)))  # each (n, H, bs, D)
        ones = torch.ones(L, H, bs, dtype=torch.int16, device=self.device)
        counts = torch.stack([b.merged.counts if b.merged is not None and b.merged.counts is not None else ones
                              for b in group])  # (n, L, H, bs)
        mk, mv, mc = merge_rows(torch.stack(k, dim=1).view(n * L * H, bs, D),
                                torch.stack(v, dim=1).view(n * L * H, bs, D), counts.view(n * L * H, bs), threshold)
        mc = mc.view(n, L, H, bs)
        live = (mc > 0).sum(dim=-1)  # (n, L, H)
        shrank = live < (counts > 0).sum(dim=-1)
        todo = [i for i in range(n) if bool(shrank[i].any())]
        for i in set(range(n)) - set(todo):
            group[i].merged = group[i].merged or SlotCounts(None)  # looked at: nothing to merge
        if not todo:
            return {}
        changed = [group[i] for i in todo]
        before, bad = self.tiers.verify(changed)
        mk = mk.view(n, L, H, bs, D).to(c.compute_dtype)
        mv = mv.view(n, L, H, bs, D).to(c.compute_dtype)
        off = torch.arange(bs, device=self.device)
        for i, b in zip(todo, changed):
            arena, local = self._devs.at(b.slot)
            where = torch.full((bs,), local, dtype=torch.long, device=self.device)
            for layer in range(L):
                self.codecs[arena.codec].write(arena.data[:, layer], layer, where, off, mk[i, layer].transpose(0, 1),
                                               mv[i, layer].transpose(0, 1))  # (bs, H, D) each
            b.checksum = None  # its bytes changed: the next move takes a new checksum
            b.merged = SlotCounts(mc[i].clone())
        after = self.tiers.retake(changed)
        out = {}
        for i, b, d, layer, new in zip(todo, changed, before, bad, after):
            out[b.id] = int((counts[i] > 0).sum()) - int(live[i].sum())
            if self.bus.enabled:
                layers = shrank[i].any(dim=-1).nonzero().squeeze(1).tolist()
                self.bus.emit(Merge, block=b.id, tier=b.tier, version=b.version, tokens=bs, heads=H, layers=layers,
                              slots=live[i].sum(dim=-1)[layers].tolist(), digest=d, digest_layer=layer, new_digest=new)
        return out

    def _drop_tail(self, s: Sequence, *, emit_release: bool) -> None:
        """Let go of blocks wholly past the sequence's length (after a short commit or a rollback)."""
        while s.blocks and s.blocks[-1].index * self.block_size >= s.length:
            b = s.blocks.pop()
            s.index_cache = None
            self._free_or_keep(b, s.id, emit_release=emit_release)

    def rollback(self, seq: Any, n: int) -> None:
        """Discard the last ``n`` committed tokens (rejected speculation); the version advances by ``n``."""
        s = self._seq(seq)
        if s.pending:
            raise ValueError(f"rollback of {seq!r} with {s.pending} reserved tokens not committed")
        if not 1 <= n <= s.length:
            raise ValueError(f"rollback of {n} tokens for {seq!r}: must be in [1, {s.length}] (its length)")
        new_len = s.length - n
        if new_len and s.blocks and all(b.index != (new_len - 1) // self.block_size for b in s.blocks):
            raise ValueError(f"rollback of {seq!r} to {new_len} tokens: the block holding its new last token was evicted")
        cut = next((b for b in s.blocks if b.index == new_len // self.block_size), None)
        if new_len % self.block_size and cut is not None and cut.merged is not None and cut.merged.counts is not None:
            raise ValueError(f"rollback of {seq!r} to {new_len} tokens: block {cut.id} holding its new last token "
                             "has merged tokens (merging keeps the newest local_blocks blocks' worth of tokens whole: widen it)")
        if self.faults.rollback_uncut and new_len:
            s.version += n  # the fault: the rollback is recorded, and the tokens stay
            if self.bus.enabled:
                self.bus.emit(Rollback, seq=seq, n=n, version=s.version)
            return
        s.length = new_len
        s.version += n
        if self.bus.enabled:
            self.bus.emit(Rollback, seq=seq, n=n, version=s.version)
        if self.prefix is not None:
            self.prefix.rolled_back(seq, new_len)
        self._drop_tail(s, emit_release=True)

    # ---- reading ----
    def ensure_resident(self, seqs: Iterable[Any]) -> None:
        """Bring every block of ``seqs`` to the device (pinning them for this step).

        Raises ``OutOfBlocks`` when they cannot all fit, ``ChecksumMismatch`` when a copy
        coming back is corrupt (the block stays where it was).
        """
        ss = [self._seq(q) for q in seqs]
        self._tick += 1
        blocks: dict[int, Block] = {}
        for s in ss:
            self._pinned.add(s.id)
            s.last_access = self._tick
            for b in s.blocks:
                blocks[b.id] = b
        cap = self.pool.tiers[Tier.DEVICE].capacity
        if len(blocks) > cap:
            raise OutOfBlocks(Tier.DEVICE, len(blocks), cap)
        missing = []
        for b in blocks.values():
            b.last_access = self._tick
            if b.inflight is not None:
                self.tiers.prefetch_hits += 1
                self.tiers.settle(b)
                b.prefetched = False
            elif b.tier != Tier.DEVICE:
                missing.append(b)
            elif b.prefetched:
                self.tiers.prefetch_hits += 1
                b.prefetched = False
        if missing:
            self.tiers.prefetch_misses += len(missing)
            self.tiers.move(missing, Tier.DEVICE, exclude=set(blocks))
            for s in ss:
                s.index_cache = None

    def plan_reads(self, seqs: Seq[Any], q_lens: Seq[int]) -> ReadPlan:
        """This step's ``ReadPlan``, built once before the forward pass: where each row's blocks are read from.

        Without long context (or when every block is on the device) the blocks are made resident, as always,
        and the plan is empty; with it, prefetches in flight land first, and each block is read where it is."""
        if self.staging is None:
            self.ensure_resident(seqs)
            return ReadPlan((), 0)
        rows = []
        self._tick += 1
        for seq, q in zip(seqs, q_lens):
            s = self._seq(seq)
            self._pinned.add(seq)
            s.last_access = self._tick
            locs = []
            for pos, b in enumerate(s.blocks):
                self.tiers.try_settle(b)  # a bad copy was dropped: the block is read where it was
                locs.append(BlockLoc(pos, b.index, b.id, b.tier, b.slot, b.version, b.codec))
            rows.append((seq, self.num_tokens(seq), q, locs))
        plan = plan_reads(rows, self.config.staging_blocks)
        if not plan.streaming:
            self.ensure_resident(seqs)  # all on the device: the resident path reads them (prefetch hits counted there)
        return plan

    def book_streamed(self, reads: dict[Any, dict[int, tuple[str, int, int]]], device_rows: int, staged_rows: int,
                      *, predict: bool) -> None:
        """After a streamed step's commit: the ``stage``, ``prefetch_use`` and ``read`` events of what attention
        read, and (``predict``: block-sparse top-k) a background prefetch of the blocks it read from slower tiers,
        which the next step's query will likely choose again, into device room the placement policy makes."""
        staged = self.staging.end_step()
        self.bytes_staged += staged.bytes_moved
        self.rows_from_device += device_rows + staged.rows_reused
        self.rows_from_slower += staged.rows_staged
        predicted: list[Block] = []
        for seq, got in reads.items():
            s = self.seqs.get(seq)
            if s is None:
                continue
            hits, misses = [], []
            for bid, (tier, _, pos) in got.items():
                b = self.pool.blocks.get(bid)
                if b is None:
                    continue
                b.last_access = self._tick
                if b.prefetched and tier == Tier.DEVICE:
                    hits.append(bid)
                    b.prefetched = False
                elif tier != Tier.DEVICE:
                    misses.append(bid)
                    predicted.append(b)
            if predict:
                self.tiers.prefetch_hits += len(hits)
                self.tiers.prefetch_misses += len(misses)
            if not self.bus.enabled:
                continue
            copies = staged.copies.get(seq, {})
            if copies:
                self.bus.emit(Stage, seq=seq, blocks=list(copies), srcs=[t for t, _ in copies.values()],
                              versions=[v for _, v in copies.values()],
                              bytes=staged.bytes_by_seq.get(seq, 0))
            if predict and (hits or misses):
                self.bus.emit(PrefetchUse, seq=seq, hits=hits, misses=misses)
            order = sorted(got.items(), key=lambda kv: kv[1][2])
            # a resident copy was read after this step's write into it: it holds the committed version
            versions = [self.pool.blocks[bid].version if t == Tier.DEVICE and bid in self.pool.blocks else v
                        for bid, (t, v, _) in order]
            self.emit_read(seq, [bid for bid, _ in order], versions=versions, tiers=[t for _, (t, _, _) in order])
        if predict and predicted and self.config.prefetch_depth:
            # room comes from the blocks the policy ranks lowest (a block read this step has just been touched)
            self.tiers.prefetch(predicted[: self.config.prefetch_depth], Tier.DEVICE, exclude=set(self._held))

    def slot_table(self, seq: Any) -> torch.Tensor:
        """``(num_blocks,)`` device-arena slots of ``seq``'s blocks in position order (paged attention).

        Brings the blocks to the device first if needed. Valid until the step ends."""
        s = self._seq(seq)
        cached = s.index_cache
        if cached is not None and cached[0] == self.pool.epoch:
            return cached[1]
        if any(b.tier != Tier.DEVICE or b.inflight is not None for b in s.blocks):
            self.ensure_resident([seq])
        t = torch.tensor([b.slot for b in s.blocks], dtype=torch.long, device=self.device)
        s.index_cache = (self.pool.epoch, t)
        return t

    def layer_kv(self, layer: int) -> torch.Tensor:
        """``(num_slots, H, 2, block_size, D)`` view of the device arena for one layer ([:, :, 0] K, [:, :, 1] V).

        For paged attention over ``slot_table``; valid until the next allocation. Only for codecs
        that store the dtype as it is, and only while every device block is in the device's own arena:
        quantized blocks, and blocks held in another codec, are read with ``read_blocks``."""
        if not self.codec.native:
            raise ValueError(f"layer_kv is a raw view and the {self.codec.name} codec stores codes: use read_blocks")
        ts = self._dev_slots
        if ts.used_by[0] != ts.used:
            held = {c: n for c, n in zip(self._devs.codecs[1:], ts.used_by[1:]) if n}
            raise ValueError(f"layer_kv is a raw view of the device's {self.codec.name} arena, and {ts.used - ts.used_by[0]} "
                             f"device blocks are held in other codecs ({held}): use read_blocks")
        return self._layer_kv(layer)

    def read_blocks(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the device-arena ``slots`` (any shape ``S``) for ``layer``, decoded to the compute
        dtype: each ``(*S, H_kv, block_size, D)``. The paged read of attention under any codec.

        With ``heads`` (shape ``S``), only that KV head of each slot is read: each ``(*S, block_size, D)``
        (block-sparse attention reads different blocks per head).

        Each block is decoded with its own codec; while every device block is in the device's own
        arena (the common case) this is one gather and one decode."""
        if self._dev_slots.used_by[0] != self._dev_slots.used:
            return self._read_mixed(layer, slots, heads)
        if heads is None:
            rows = self._dev.data[:, layer].index_select(0, slots.reshape(-1))  # (n, H, R)
            k, v = self.codec.read(rows, layer)  # (n, H, bs, D) each
            return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])
        flat_heads = heads.reshape(-1)
        rows = self._dev.data[:, layer][slots.reshape(-1), flat_heads]  # (n, R)
        k, v = self.codec.read(rows[:, None], layer, flat_heads)  # (n, 1, bs, D) each
        return k.view(*slots.shape, *k.shape[2:]), v.view(*slots.shape, *v.shape[2:])

    def _read_mixed(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``read_blocks`` over device slots in several codec arenas: one gather and decode per arena."""
        c, devs = self.config, self._devs
        flat = slots.reshape(-1)
        where, local = flat >> devs.shift, flat & devs.mask
        H = 1 if heads is not None else c.num_kv_heads
        shape = (flat.numel(), H, self.block_size, c.head_dim)
        k = torch.zeros(shape, dtype=c.compute_dtype, device=self.device)  # (n, H, bs, D)
        v = torch.zeros(shape, dtype=c.compute_dtype, device=self.device)
        flat_heads = heads.reshape(-1) if heads is not None else None
        for i, arena in enumerate(devs.arenas):
            if arena is None or (i and not self._dev_slots.used_by[i]):
                continue
            sel = (where == i).nonzero().squeeze(1)
            if not sel.numel() or not arena.num_slots:  # an empty own arena: only padding points there
                continue
            codec = self.codecs[arena.codec]
            if flat_heads is None:
                rows = arena.data[:, layer].index_select(0, local[sel])  # (m, H, R)
                k[sel], v[sel] = codec.read(rows, layer)
            else:
                h = flat_heads[sel]
                rows = arena.data[:, layer][local[sel], h]  # (m, R)
                k[sel], v[sel] = codec.read(rows[:, None], layer, h)
        if heads is not None:
            return k.view(*slots.shape, *shape[2:]), v.view(*slots.shape, *shape[2:])
        return k.view(*slots.shape, *shape[1:]), v.view(*slots.shape, *shape[1:])

    def num_tokens(self, seq: Any) -> int:
        """Tokens ``gather`` returns: committed and reserved, less any evicted blocks."""
        s = self._seq(seq)
        if not s.blocks:
            return 0
        return (len(s.blocks) - 1) * self.block_size + (s.length + s.pending - s.blocks[-1].index * self.block_size)

    def gather(self, seq: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq``'s cached K and V for ``layer``, each ``(H_kv, T, D)`` on the device, in position order.

        Includes tokens stored but not yet committed; evicted blocks are skipped."""
        s = self._seq(seq)
        idx = self.slot_table(seq)
        if layer == 0:
            s.last_access = self._tick
        c = self.config
        T = self.num_tokens(seq)
        kb, vb = self.read_blocks(layer, idx)  # (nb, H, bs, D) each
        nb = kb.shape[0]
        k = kb.transpose(0, 1).reshape(c.num_kv_heads, nb * self.block_size, c.head_dim)[:, :T]  # (H, T, D)
        v = vb.transpose(0, 1).reshape(c.num_kv_heads, nb * self.block_size, c.head_dim)[:, :T]  # (H, T, D)
        return k, v

    def sample_reads(self, seqs: Seq[Any]) -> list[int] | None:
        """For each of ``seqs``' next whole reads, the block (an index into its table; -1: none) the sampler
        picks to verify, for a reader that takes a block's digest in its own pass over the bytes (the compiled
        decode layers): it then hands ``emit_read`` what it found (``checked``), and the read is not sampled
        again. None unless someone listens with ``verify="sample"`` (``emit_read`` then verifies as usual)."""
        if not (self.bus.enabled and self.digests.mode == "sample"):
            return None
        picked = [self.digests.sample(self._seq(seq).blocks) for seq in seqs]
        return [p[0] if p else -1 for p in picked]

    def emit_read(self, seq: Any, blocks: Seq[int] | None = None, layer: int | None = None, *,
                  versions: Seq[int] | None = None, tiers: Seq[str] | None = None,
                  checked: tuple[int, int | None] | None = None) -> None:
        """Record that attention read ``blocks`` of ``seq`` (default: all), with the versions read (default: each
        block's own; long context passes those of the staged copies it read, and the tier each came from).
        ``checked``: the read was sampled by ``sample_reads``: ``(block index, digest over the bytes read)`` of
        the block it picked, or ``(-1, None)`` when it picked none."""
        if not self.bus.enabled:
            return
        s = self._seq(seq)
        if blocks is None:
            read = s.blocks
            ids = [b.id for b in read]
            versions = [b.version for b in read]
        else:
            ids = list(blocks)
            read = [self.pool.blocks.get(i) for i in ids]
            versions = list(versions) if versions is not None else [b.version if b is not None else -1 for b in read]
        digests = layers = None
        if checked is None:
            chosen = [i for i in self.digests.sample(read) if read[i] is not None]
        else:
            chosen = [checked[0]] if checked[0] >= 0 else []
        if chosen:
            confirmed = checked is not None and self._confirms(read[checked[0]], checked[1])
            got, bad = ([checked[1]], [None]) if confirmed else self.tiers.verify([read[i] for i in chosen])
            digests, layers = [None] * len(ids), [None] * len(ids)
            for i, d, lay in zip(chosen, got, bad):
                digests[i], layers[i] = d, lay
            if not any(lay is not None for lay in layers):
                layers = None
        self.bus.emit(Read, seq=seq, blocks=ids, versions=versions, layer=layer, digests=digests, digest_layers=layers,
                      tiers=list(tiers) if tiers is not None else None)

    def _confirms(self, b: Block, digest: int | None) -> bool:
        """Whether ``digest``, taken by a reader over ``b``'s bytes, is its record's: the reader's digest stands.
        Otherwise (no record, a mismatch) ``tiers.verify`` looks again, and names the first layer that differs."""
        rec = b.digest
        return rec is not None and rec.codec == b.codec and digest == self.digests.recorded(rec)

    def observe_attention(self, seq: Any, layer: int | None, block_scores: Seq[float] | torch.Tensor) -> None:
        """Feed the hybrid policy: attention mass of ``seq``'s newest query on each of its blocks
        (position order, one value per block of ``block_table``), accumulated with decay.

        ``layer``: the layer the mass was measured at, or None for the mean over every layer (the
        runner's way: one observation per statistics step, so the decay counts steps, not layers)."""
        s = self._seq(seq)
        scores = block_scores.tolist() if isinstance(block_scores, torch.Tensor) else list(block_scores)
        if len(scores) != len(s.blocks):
            raise ValueError(f"observe_attention for {seq!r}: {len(scores)} scores for {len(s.blocks)} blocks")
        for b, w in zip(s.blocks, scores):
            b.importance = b.importance * IMPORTANCE_DECAY + float(w)

    def score_hook(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the runner passes as ``corrupt=`` to attention at ``layer``: None unless the
        attention-nan fault is on and targets this layer and step."""
        return self.faults.score_hook(layer, self.bus.step)

    # ---- explicit tier moves ----
    def _blocks(self, ids: Iterable[int]) -> list[Block]:
        try:
            return [self.pool.blocks[i] for i in ids]
        except KeyError as exc:
            raise ValueError(f"block {exc.args[0]} is not allocated") from None

    def swap_out(self, blocks: Iterable[int], dst: str = Tier.HOST) -> None:
        if dst not in self.pool.tiers or dst == Tier.DEVICE:
            raise ValueError(f"swap_out to {str(dst)!r}: must be one of {', '.join(self.config.tiers[1:])}")
        self.tiers.move(self._blocks(blocks), dst)

    def evict(self, blocks: Iterable[int], reason: str = "importance") -> None:
        """Drop blocks for good, from every owner (importance eviction: H2O, StreamingLLM); an ``evict``
        event per block. The caller keeps a sequence's newest block: its next token goes there."""
        victims = self._blocks(blocks)
        for b in victims:
            self.tiers.try_settle(b)  # the block is being dropped anyway: a bad copy of it is simply discarded
            self._evict([b], b.tier, reason)

    def swap_in(self, blocks: Iterable[int]) -> None:
        self.tiers.move(self._blocks(blocks), Tier.DEVICE)

    def prefetch(self, seq: Any, max_blocks: int | None = None) -> int:
        """Start bringing up to ``prefetch_depth`` (and ``max_blocks``) of ``seq``'s blocks back to the
        device in the background (a scheduler calls this for the sequences it will run next). Returns how many."""
        depth = self.config.prefetch_depth if max_blocks is None else min(self.config.prefetch_depth, max_blocks)
        if depth <= 0:
            return 0
        s = self._seq(seq)
        away = [b for b in s.blocks if b.tier != Tier.DEVICE and b.inflight is None][:depth]
        return self.tiers.prefetch(away, Tier.DEVICE, exclude={b.id for b in s.blocks})

    # ---- steps and stats ----
    def end_step(self, num_tokens: int = 0) -> None:
        """Book finished prefetches, emit each tier's usage, close the step on the bus, unpin."""
        self.tiers.poll()
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(self._used_bytes(t) for t in self.pool.tiers))
        if self.bus.enabled:
            landing = {t: 0 for t in self.pool.tiers}  # slots held for prefetches still in flight
            landing_bytes = {t: 0 for t in self.pool.tiers}
            for b in self.tiers.inflight.values():
                landing[b.inflight.dst] += 1
                landing_bytes[b.inflight.dst] += self.config.layout(b.codec).bytes_per_block
            for t, ts in self.pool.tiers.items():
                # blocks as the events place them: an in-flight copy counts where it comes from until it lands
                used = ts.used - landing[t]
                self.bus.emit(Usage, tier=t, used_blocks=used, capacity_blocks=ts.capacity,
                              bytes=self._used_bytes(t) - landing_bytes[t])
        if self.prefix is not None:
            hits, misses = self.prefix.end_step()
            self.bus.end_step(num_tokens, prefix_hits=hits, prefix_misses=misses)
        else:
            self.bus.end_step(num_tokens)
        self.digests.end_step()
        self._pinned.clear()
        self._reserved.clear()
        self._held.clear()

    def _blocks_by_codec(self, tier: str) -> dict[str, int]:
        ts = self.pool.tiers[tier]
        return {c: n for c, n in zip(self.tier_arenas[tier].codecs, ts.used_by) if n}

    def _used_bytes(self, tier: str) -> int:
        """Bytes the blocks in ``tier`` take, each in its own codec's layout (padding included)."""
        return sum(n * self.config.layout(c).bytes_per_block for c, n in self._blocks_by_codec(tier).items())

    def stats(self) -> dict[str, Any]:
        """Occupancy per tier (blocks and the real bytes of each block's codec), tokens, prefetch and swaps."""
        bs = self.block_size
        tiers = {}
        for t, ts in self.pool.tiers.items():
            by_codec = self._blocks_by_codec(t)
            tiers[t] = {
                "capacity_blocks": ts.capacity, "used_blocks": ts.used, "free_blocks": ts.num_free,
                "used_bytes": self._used_bytes(t), "arena_bytes": self.tier_arenas[t].nbytes,
                "codec": self.config.tier_codec(t), "blocks_by_codec": by_codec,
                "bytes_by_codec": {c: n * self.config.layout(c).bytes_per_block for c, n in by_codec.items()},
            }
        held: dict[int, int] = {}  # block -> token slots in use (the longest owner's view of a shared block)
        for q in self.seqs.values():
            end = q.length + q.pending
            for b in q.blocks:
                held[b.id] = max(held.get(b.id, 0), min(bs, end - b.index * bs))
        tokens = sum(held.values())
        slots = len(self.pool.blocks) * bs
        return {
            "tiers": tiers,
            "sequences": len(self.seqs),
            "blocks": len(self.pool.blocks),
            "tokens": tokens,
            "kv_bytes": sum(t["used_bytes"] for t in tiers.values()),  # resident in every tier, each block in its codec
            "peak_kv_bytes": self.peak_kv_bytes,
            "recodes": self.num_recodes,
            "fragmentation": (1 - tokens / slots) if slots else 0.0,  # empty slots in allocated blocks
            "prefetch_hits": self.tiers.prefetch_hits,
            "prefetch_misses": self.tiers.prefetch_misses,
            "prefetch_hit_rate": self.tiers.hit_rate,
            "swaps": {f"{s}->{d}": int(n) for (s, d), (n, _) in self.tiers.moved.items()},
            **({"prefix": self.prefix.stats()} if self.prefix is not None else {}),
        }

    def close(self) -> None:
        """Stop the prefetch worker, flush events, close an environment trace, delete spill files."""
        if self._closed:
            return
        self._closed = True
        self.tiers.close()
        for attached in self._attached:
            attached.detach()
        self.bus.flush()
        if self._writer is not None:
            self.bus.unsubscribe(self._writer.write_many)
            self._writer.close()
            self._writer = None
            atexit.unregister(self.close)
        for a in self.tier_arenas.values():
            a.close()

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
