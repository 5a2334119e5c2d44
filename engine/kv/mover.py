"""Moving blocks between tiers: batched swaps, checksums on every move, asynchronous prefetch.

Swapping out (to a slower tier) takes the block's checksum if its bytes changed
since the last one; swapping in (to a faster tier) checks the copy that arrived
against it, and a mismatch is emitted as ``checksum_error`` and raised as
``ChecksumMismatch`` while the block stays where it was: the corrupt copy is never
served. When the destination is full, a prefix cache gives up its blocks that no request
holds first (``reclaim``: moved down while there is free room below, else evicted); then the
eviction policy picks victims there and they are demoted one tier further down; only the last
tier evicts a request's blocks.

Codecs: a block moving down to a tier with a lossier codec is re-encoded on the
way (decoded from its codec, encoded in the tier's, per layer over the whole
batch) and keeps the lossier codec from then on; a block moving up is copied as
it is and keeps its codec, held in the faster tier's arena of that codec (fewer
bytes, and no pretended precision). The checksum is always that of the bytes that
landed, so after a re-encode it is the checksum of the new bytes.

Prefetch copies on a single background thread (on a side CUDA stream where there
is one). The worker only moves bytes between slots reserved for it; every
bookkeeping change and every event happens on the caller's thread when the copy
is *settled* (when the block is needed, or at the end of the step), so event order
and the pool never depend on thread timing.

When storage fails (a disk full as an arena grows, a copy that cannot read or write, a spill
file cut short under the engine) the move is undone, the failure is emitted as ``io_error`` and
raised as ``StorageError``: nothing half-moved is booked, every slot taken for it goes back. The
blocks of a file cut short are *lost*: their slots are remembered, every later move of them is
refused with a ``StorageError`` naming them (so a scheduler fails their requests), and the slots
become usable again once something new is written there. A failed prefetch only leaves its blocks
where they were.

Each prefetch is also a transfer in the trace's vocabulary (``transfer_start`` with ``op`` ``move``, closed by
``transfer_done`` or ``transfer_failed`` when the first of its blocks is settled: ``transfers``), so a block
freed, written or handed out while its copy is in flight is visible to ``checks/transfer`` as on any engine. A
move's blocks stay valid where they were until it is done, and a failed one leaves them there.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ...events import ChecksumError, IoError, Prefetch, SwapIn, SwapOut
from ..bus import Bus
from ..config import TIER_NAMES, EngineConfig, Tier
from ..errors import ChecksumMismatch, OutOfBlocks, StorageError
from ..faults import Faults
from .blockcopy import ArenaPair, arena_pairs, copy_pairs, transcode
from .checksum import prepare as prepare_checksums, sum64 as _sum64
from .codecs import Codec, lossier
from .digest import DigestBook
from .policy import EvictionPolicy
from .pool import Block, BlockPool
from .storage import DiskArena, TierArenas
from .transfers import Transfer, Transfers

__all__ = ["TierMover"]

_RANK = {t: i for i, t in enumerate(TIER_NAMES)}


@dataclass(slots=True)
class _Inflight:
    future: Future
    src: str
    dst: str
    slot: int  # reserved in dst
    i: int  # this block's index in the job's result
    transfer: Transfer


class TierMover:
    """Owns the arenas' contents in motion; the pool owns the bookkeeping it updates."""

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        arenas: dict[str, TierArenas],
        bus: Bus,
        policy: EvictionPolicy,
        faults: Faults,
        codecs: dict[str, Codec],
        *,
        protected: Callable[[Block], bool],
        evictable: Callable[[Block], bool],
        evict: Callable[[list[Block], str], None],
        distance: Callable[[Block], float],
        clock: Callable[[], int],
        digests: DigestBook,
        reclaim: Callable[[str, int, set[int]], None] | None = None,
    ) -> None:
        self.config, self.pool, self.arenas, self.bus = config, pool, arenas, bus
        self.codecs = codecs  # codec name -> Codec, for re-encoding on the way down
        self.policy, self.faults = policy, faults
        self._protected, self._evictable, self._evict = protected, evictable, evict
        self._distance, self._clock = distance, clock
        self._reclaim = reclaim  # frees room from a prefix cache before anything else is moved
        self.digests = digests
        self._worker: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(device=config.device) if config.is_cuda else None
        self.inflight: dict[int, Block] = {}
        self.transfers = Transfers(bus, held=faults.free_during_prefetch)
        # side tables by block id (the pool forgets a dropped block in each): blocks brought up by a prefetch and
        # not yet counted as a hit; and, under the stale-version fault only, the (tier, slot, version, checksum)
        # of the slower copy a swap-in kept "in case"
        self.prefetched: set[int] = set()
        self.retained: dict[int, tuple[str, int, int, int | None]] = {}
        pool.track(self.prefetched.discard)
        pool.track(self._give_back, held=lambda: [(tier, slot) for tier, slot, _, _ in self.retained.values()])
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.moved: dict[tuple[str, str], list[float]] = {}  # (src, dst) -> [blocks, seconds]
        self.lost: dict[str, set[int]] = {t: set() for t in config.tiers}  # slots whose bytes a cut file took
        if config.checksums and (Tier.DISK in config.tiers or (not config.is_cuda and len(config.tiers) > 1)):
            prepare_checksums()  # the kernel for copies through host memory: set up at start, not in a decode step

    def take_prefetched(self, b: Block) -> bool:
        """Whether ``b`` was brought up by a prefetch not yet counted as a hit; it is counted now (once)."""
        if b.id not in self.prefetched:
            return False
        self.prefetched.discard(b.id)
        return True

    def _give_back(self, block_id: int) -> None:
        """The block went: the slot of a copy it kept (stale-version fault) goes back to its tier."""
        kept = self.retained.pop(block_id, None)
        if kept is not None:
            self.pool.slots[kept[0]].give(kept[1])

    # ---- room ----
    def slower(self, tier: str) -> str | None:
        tiers = self.config.tiers
        i = tiers.index(tier)
        return tiers[i + 1] if i + 1 < len(tiers) else None

    def make_room(self, tier: str, n: int, exclude: set[int]) -> None:
        """Free ``n`` slots in ``tier``: a prefix cache's idle blocks first, then by demoting policy-chosen
        blocks one tier down (evicting from the last tier); raises ``OutOfBlocks`` without demoting
        anything if that cannot work (the prefix cache may have given up blocks by then)."""
        slots = self.pool.slots[tier]
        need = n - slots.num_free
        if need <= 0:
            return
        # A prefetch landing here already holds its slot: land it, so the policy may demote it again.
        for b in [b for b in self.inflight.values() if b.inflight.dst == tier and b.id not in exclude
                  and not self._protected(b)]:
            self.try_settle(b)
        need = n - slots.num_free
        if need > 0 and self._reclaim is not None:
            self._reclaim(tier, need, exclude)
            need = n - slots.num_free
        if need <= 0:
            return
        nxt = self.slower(tier)
        cands = [
            b for b in self.pool.blocks.values()
            if b.tier == tier and b.id not in exclude and b.inflight is None and not self._protected(b)
            and (nxt is not None or self._evictable(b))
        ]
        if len(cands) < need:
            raise OutOfBlocks(tier, n, slots.num_free + len(cands))
        victims = self.policy.victims(cands, need, self._clock(), self._distance)
        if nxt is None:
            self._evict(victims, tier)
        else:
            self.move(victims, nxt, exclude=exclude)

    # ---- synchronous moves ----
    def move(self, blocks: Iterable[Block], dst: str, exclude: set[int] | None = None) -> None:
        """Move ``blocks`` (from any tiers) to ``dst`` in batches per source tier.

        Makes room in ``dst`` first. Blocks whose copy fails its checksum stay where they
        were; the first mismatch is raised after the rest have moved.
        """
        blocks = [b for b in blocks if b.tier != dst]
        for b in blocks:
            if b.inflight is not None:
                self.settle(b)
        blocks = [b for b in blocks if b.tier != dst]
        if not blocks:
            return
        self._readable(blocks)
        keep = set(exclude or ()) | {b.id for b in blocks}
        try:
            self.make_room(dst, len(blocks), keep)
        except OutOfBlocks:
            if any(_RANK[b.tier] <= _RANK[dst] for b in blocks):
                raise
            self._exchange(blocks, dst, keep)
            return
        dst_slots = self.take(dst, [self._arena_index(b, dst) for b in blocks])
        try:
            self._check_spill(dst, dst_slots)  # a file cut short is made whole before a write reaches it
        except StorageError:
            self._give(dst, dst_slots)
            raise
        self.lost[dst].difference_update(dst_slots)
        by_src: dict[str, list[int]] = {}
        for i, b in enumerate(blocks):
            by_src.setdefault(b.tier, []).append(i)
        groups = [([blocks[i] for i in idx], [dst_slots[i] for i in idx]) for idx in by_src.values()]
        bad: ChecksumMismatch | None = None
        for g, (group, slots) in enumerate(groups):
            src = group[0].tier
            t0 = time.perf_counter()
            try:
                if _RANK[dst] > _RANK[src]:
                    self._swap_out(group, src, dst, slots)
                else:
                    err = self._swap_in(group, src, dst, slots)
                    bad = bad or err
            except (OSError, StorageError) as exc:
                # nothing of this group or the next was booked: their slots go back, the blocks stay
                self._give(dst, [slot for group_, slots_ in groups[g:] for b, slot in zip(group_, slots_)
                                 if b.tier != dst])
                raise self._failed(exc, dst if _RANK[dst] > _RANK[src] else src,
                                   "write" if _RANK[dst] > _RANK[src] else "read") from None
            acc = self.moved.setdefault((src, dst), [0, 0.0])
            acc[0] += len(group)
            acc[1] += time.perf_counter() - t0
        if bad is not None:
            raise bad

    # ---- when storage fails ----
    def _failed(self, exc: BaseException, tier: str, op: str) -> StorageError:
        """``exc`` (an arena's ``StorageError``, or the ``OSError`` of a copy) as the typed error, recorded as
        an ``io_error`` event whose ``op`` is what the tier could not do: ``grow``, ``read`` or ``write``."""
        if not isinstance(exc, StorageError):
            exc = StorageError(tier, op, getattr(exc, "errno", None), getattr(exc, "filename", None),
                               getattr(exc, "strerror", None) or str(exc))
        if self.bus.enabled:
            self.bus.emit(IoError, tier=exc.tier, op=op, message=str(exc), errno=exc.errno, path=exc.path,
                          blocks=list(exc.blocks))
        return exc

    def _give(self, tier: str, slots: list[int]) -> None:
        ts = self.pool.slots[tier]
        for s in slots:
            ts.give(s)

    def _check_spill(self, tier: str, slots: list[int]) -> None:
        """Before a move touches ``slots`` of ``tier``: if a spill file holding them was cut short under the
        engine, remember every slot it lost (an ``io_error`` names the blocks that lived there)."""
        ta = self.arenas[tier]
        if not isinstance(ta.primary, DiskArena):
            return  # memory is not cut short under the engine (a tier's arenas are all of one kind)
        by_arena: dict[int, list[int]] = {}
        for s in slots:
            by_arena.setdefault(s >> ta.shift, []).append(s & ta.mask)
        for index, local in by_arena.items():
            arena = ta.get(index)
            try:
                cut = {ta.slot(index, x) for x in arena.cut_short(local)}
            except StorageError as exc:
                raise self._failed(exc, tier, "read") from None
            if cut:
                self.lost[tier] |= cut
                gone = self._lost_blocks(tier)
                self._failed(StorageError(tier, "read", None, arena.dir, "a spill file was cut short under the "
                                          f"engine; the bytes of {len(gone)} block(s) are gone", tuple(gone)),
                             tier, "read")

    def _lost_blocks(self, tier: str) -> list[int]:
        lost = self.lost[tier]
        return sorted(b.id for b in self.pool.blocks.values() if b.tier == tier and b.slot in lost)

    def _readable(self, blocks: list[Block]) -> None:
        """Raise ``StorageError`` naming every lost block of a slower tier if any of ``blocks`` is one."""
        by_tier: dict[str, list[int]] = {}
        for b in blocks:
            if b.tier != Tier.DEVICE:
                by_tier.setdefault(b.tier, []).append(b.slot)
        for tier, slots in by_tier.items():
            self._check_spill(tier, slots)
            if self.lost[tier].intersection(slots):
                gone = self._lost_blocks(tier)
                raise StorageError(tier, "read", None, None, f"the bytes of blocks {gone} were lost with their "
                                   "spill file", tuple(gone))

    def _exchange(self, blocks: list[Block], dst: str, keep: set[int]) -> None:
        """Swap-in when ``dst`` is full and the tiers below have no room for its victims except
        the slots the incoming blocks are leaving: stage the incoming copies, verify them, give
        their slots up, demote the victims into that room, then land the staged copies."""
        staged = [self._at(b.tier, b.slot).clone() for b in blocks]  # (1, L, H, R) each, in the block's codec
        actual = [_sum64(t)[0] for t in staged] if self.config.checksums else [None] * len(blocks)
        bad: ChecksumMismatch | None = None
        good: list[tuple[int, Block, str]] = []
        for i, (b, got) in enumerate(zip(blocks, actual)):
            if got is not None and b.checksum is not None and got != b.checksum:
                if self.bus.enabled:
                    self.bus.emit(ChecksumError, block=b.id, tier=b.tier, expected=b.checksum, actual=got)
                bad = bad or ChecksumMismatch(b.id, b.tier, b.checksum, got)
            else:
                good.append((i, b, b.tier))
        for _, b, src in good:
            self.pool.slots[src].give(b.slot)
        try:
            self.make_room(dst, len(good), keep)
        except (OutOfBlocks, StorageError):
            for i, b, src in good:  # nothing moved: put the staged copies back where they came from
                b.slot = self.pool.slots[src].take(self.arenas[src].index(b.codec))
                self.lost[src].discard(b.slot)  # (a slot a cut file lost holds these good bytes now)
                self._at(src, b.slot).copy_(staged[i])
            raise
        for (i, b, src), slot in zip(good, self.take(dst, [self._arena_index(b, dst) for _, b, _ in good])):
            self._at(dst, slot).copy_(staged[i])
            if actual[i] is not None:
                b.checksum = actual[i]
            b.tier, b.slot = dst, slot
            self.pool.epoch += 1
            if self.bus.enabled:
                (d,), (layer,) = self.verify([b])
                self.bus.emit(SwapIn, block=b.id, src=src, dst=dst, version=b.version, codec=b.codec, digest=d,
                              digest_layer=layer)
        if bad is not None:
            raise bad

    # ---- content digests (engine.kv.digest) ----
    def verify(self, blocks: list[Block]) -> tuple[list[int | None], list[int | None]]:
        """Digests recomputed over the blocks' bytes where they sit, and the first layer differing from each
        block's record (all None unless someone listens)."""
        if not (self.bus.enabled and self.digests.recording):
            return [None] * len(blocks), [None] * len(blocks)
        rows = [self._at(b.tier, b.slot)[0] if b.inflight is None else None for b in blocks]
        return self.digests.verify(blocks, rows)

    def retake(self, blocks: list[Block]) -> list[int | None]:
        """After a re-encode: the blocks' records become their new bytes' (forgotten unless someone listens)."""
        if not (self.bus.enabled and self.digests.recording):
            for b in blocks:
                b.digest = None
            return [None] * len(blocks)
        return self.digests.retake(blocks, [self._at(b.tier, b.slot)[0] for b in blocks])

    def _at(self, tier: str, slot: int) -> torch.Tensor:
        """``(1, L, H, R)`` view of the block at tier slot ``slot``."""
        arena, local = self.arenas[tier].at(slot)
        return arena.view(local, 1)

    def dst_codec(self, b: Block, dst: str) -> str:
        """The codec ``b`` is held in once in ``dst``: re-encoded down to a lossier tier's, never back up."""
        return lossier(b.codec, self.config.tier_codec(dst))

    def _arena_index(self, b: Block, dst: str) -> int:
        return self.arenas[dst].index(self.dst_codec(b, dst))

    def _copy(self, src: str, src_slots: list[int], dst: str, dst_slots: list[int], *, checksum: bool
              ) -> list[int | None]:
        """``copy_slots`` between tier slots that may lie in several arenas: one batch per arena pair."""
        return copy_pairs(arena_pairs(self.arenas[src], src_slots, self.arenas[dst], dst_slots), len(src_slots),
                          checksum=checksum)

    def take(self, tier: str, arenas: list[int]) -> list[int]:
        """One slot of ``tier`` in each of the given arenas (all or none)."""
        ts = self.pool.slots[tier]
        taken: list[int] = []
        try:
            for a in arenas:
                taken.append(ts.take(a))
        except BaseException as exc:
            for s in taken:
                ts.give(s)
            if isinstance(exc, StorageError):  # an arena could not grow (a full disk)
                raise self._failed(exc, tier, "grow") from None
            raise
        return taken

    def _swap_out(self, group: list[Block], src: str, dst: str, slots: list[int]) -> None:
        copy_from, copy_to, copied = [], [], []
        for b, slot in zip(group, slots):
            kept = self.retained.get(b.id)
            if kept is not None and kept[0] == dst:
                # stale-version fault: "the copy is already there" - reuse the one left at the
                # last swap-in without comparing versions; the fresh slot goes back unused.
                self.pool.slots[dst].give(slot)
                _, slot, old_version, old_checksum = self.retained.pop(b.id)
                emitted = b.version
                self.pool.move(b, dst, slot)
                b.codec = self.arenas[dst].codecs[slot >> self.arenas[dst].shift]  # and the old copy's codec
                b.version, b.checksum = old_version, old_checksum
                if self.bus.enabled:
                    self.bus.emit(SwapOut, block=b.id, src=src, dst=dst, version=emitted, codec=b.codec)
                continue
            self.prefetched.discard(b.id)  # a prefetch that goes back down before use was no hit
            copy_from.append(b.slot)
            copy_to.append(slot)
            copied.append(b)
        # the checksum of the bytes that left, taken as they land, is what the swap-in will expect;
        # a block not written since its last checksum keeps it; a re-encoded one gets that of its new bytes
        codecs = [self.dst_codec(b, dst) for b in copied]
        left, bad = self.verify(copied)  # the bytes leaving, against what was written into them
        same = [i for i, b in enumerate(copied) if codecs[i] == b.codec]
        need = self.config.checksums and any(copied[i].checksum is None for i in same)
        sums: list[int | None] = [None] * len(copied)
        got = self._copy(src, [copy_from[i] for i in same], dst, [copy_to[i] for i in same], checksum=need)
        for i, c in zip(same, got):
            sums[i] = c
        recode: dict[tuple[str, str], list[int]] = {}
        for i, b in enumerate(copied):
            if codecs[i] != b.codec:
                recode.setdefault((b.codec, codecs[i]), []).append(i)
        for (c_src, c_dst), idx in recode.items():
            got = self.recode(src, [copy_from[i] for i in idx], c_src, dst, [copy_to[i] for i in idx], c_dst)
            for i, c in zip(idx, got):
                sums[i] = c
        recoded = [i for i, b in enumerate(copied) if codecs[i] != b.codec]
        for b, slot, c, codec in zip(copied, copy_to, sums, codecs):
            if c is not None or codec != b.codec:
                b.checksum = c
            b.codec = codec
            self.pool.move(b, dst, slot)
        new: list[int | None] = [None] * len(copied)
        for i, d in zip(recoded, self.retake([copied[i] for i in recoded])):
            new[i] = d
        if self.bus.enabled:
            for b, d, layer, nd in zip(copied, left, bad, new):
                self.bus.emit(SwapOut, block=b.id, src=src, dst=dst, version=b.version, codec=b.codec, digest=d,
                              digest_layer=layer, new_digest=nd)

    def recode(self, src: str, src_slots: list[int], src_codec: str, dst: str, dst_slots: list[int],
               dst_codec: str) -> list[int | None]:
        """Re-encode blocks at tier slots ``src_slots`` (all in ``src_codec``) into ``dst_slots`` of ``dst``
        (all in ``dst_codec``); returns the checksums of the new bytes (None with checksums off)."""
        sa, da = self.arenas[src], self.arenas[dst]
        return transcode(sa.get(sa.index(src_codec)), [x & sa.mask for x in src_slots], self.codecs[src_codec],
                         da.get(da.index(dst_codec)), [x & da.mask for x in dst_slots], self.codecs[dst_codec],
                         checksum=self.config.checksums)

    def _swap_in(self, group: list[Block], src: str, dst: str, slots: list[int]) -> ChecksumMismatch | None:
        actual = self._copy(src, [b.slot for b in group], dst, slots, checksum=self.config.checksums)
        bad = None
        for b, slot, got in zip(group, slots, actual):
            err = self._arrive(b, src, dst, slot, got)
            bad = bad or err
        return bad

    def _arrive(self, b: Block, src: str, dst: str, slot: int, got: int | None) -> ChecksumMismatch | None:
        """Book a copy that reached ``slot`` of ``dst``: verify it, then make it the block's copy."""
        if got is not None and b.checksum is not None and got != b.checksum:
            self.pool.slots[dst].give(slot)  # the corrupt copy is dropped; the block stays in src
            if self.bus.enabled:
                self.bus.emit(ChecksumError, block=b.id, tier=src, expected=b.checksum, actual=got)
            return ChecksumMismatch(b.id, src, b.checksum, got)
        if got is not None:
            b.checksum = got
        if self.faults.stale_version and src != Tier.DEVICE and b.id not in self.retained:
            self.retained[b.id] = (src, b.slot, b.version, b.checksum)  # keep the slower copy "in case" (the fault)
            b.tier, b.slot = dst, slot
            self.pool.epoch += 1
        else:
            self.pool.move(b, dst, slot)
        if self.bus.enabled:
            (d,), (layer,) = self.verify([b])  # the copy that arrived, against what was written into the block
            self.bus.emit(SwapIn, block=b.id, src=src, dst=dst, version=b.version, codec=b.codec, digest=d,
                          digest_layer=layer)
        return None

    # ---- asynchronous prefetch ----
    def prefetch(self, blocks: Iterable[Block], dst: str = Tier.DEVICE, exclude: set[int] | None = None) -> int:
        """Start bringing ``blocks`` up to ``dst`` in the background; returns how many started.

        Uses free room in ``dst`` and demotes what the policy allows; when there is not
        enough, prefetches fewer blocks rather than failing.
        """
        blocks = [b for b in blocks if b.tier != dst and b.inflight is None and _RANK[b.tier] > _RANK[dst]]
        try:
            for tier in {b.tier for b in blocks}:
                self._check_spill(tier, [b.slot for b in blocks if b.tier == tier])
        except StorageError:
            return 0  # a hint: the swap-in that needs these blocks reports it
        blocks = [b for b in blocks if b.slot not in self.lost[b.tier]]  # lost: only a swap-in reports them
        if not blocks:
            return 0
        keep = set(exclude or ()) | {b.id for b in blocks}
        try:
            self.make_room(dst, len(blocks), keep)
        except (OutOfBlocks, StorageError):  # a hint, not a demand: take what already fits
            blocks = blocks[: self.pool.slots[dst].num_free]
        if not blocks:
            return 0
        try:
            dst_slots = self.take(dst, [self._arena_index(b, dst) for b in blocks])
        except StorageError:
            return 0
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdoctor-prefetch")
        by_src: dict[str, list[int]] = {}
        for i, b in enumerate(blocks):
            by_src.setdefault(b.tier, []).append(i)
        for src, idx in by_src.items():
            group = [blocks[i] for i in idx]
            slots = [dst_slots[i] for i in idx]
            ready = None
            if self._stream is not None:  # the side stream must not overtake work queued on the slots it writes
                ready = torch.cuda.Event()
                ready.record()
            # arenas are resolved (and made) here: the worker only copies
            pairs = arena_pairs(self.arenas[src], [b.slot for b in group], self.arenas[dst], slots)
            if self.bus.enabled:
                self.bus.emit(Prefetch, blocks=[b.id for b in group], src=src, dst=dst)
            transfer = self.transfers.start(group, src, dst)
            fut = self._worker.submit(self._copy_job, pairs, len(group), ready, transfer.gate)
            for i, (b, slot) in enumerate(zip(group, slots)):
                b.inflight = _Inflight(fut, src, dst, slot, i, transfer)
                self.inflight[b.id] = b
        return len(blocks)

    def _copy_job(self, pairs: list[ArenaPair], n: int, ready: Any, gate: Any) -> list[int | None]:
        """Runs on the worker thread: bytes only, no bookkeeping."""
        if gate is not None:
            gate.wait()
        for sa, s_, _, _, _ in pairs:  # a spill file cut since the prefetch was queued would fault the copy
            if isinstance(sa, DiskArena) and set(sa.cut_short(s_, restore=False)).intersection(s_):
                raise StorageError(sa.tier, "read", None, sa.dir, "a spill file was cut short under the engine")
        if self._stream is None:
            return copy_pairs(pairs, n, checksum=self.config.checksums)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            out = copy_pairs(pairs, n, checksum=self.config.checksums, non_blocking=True)
        self._stream.synchronize()
        return out

    def settle(self, b: Block) -> None:
        """Wait for ``b``'s prefetch and book it (raises ``ChecksumMismatch`` for a bad copy, ``StorageError`` for a
        copy that failed)."""
        job: _Inflight = b.inflight
        b.inflight = None
        del self.inflight[b.id]
        if job.transfer.gate is not None:
            job.transfer.gate.set()  # free-during-prefetch: a copy a step waits for goes ahead
        try:
            got = job.future.result()[job.i]
        except (OSError, StorageError) as exc:  # the copy failed: its slot goes back, the block stays behind
            self.pool.slots[job.dst].give(job.slot)
            self.transfers.finished(job.transfer, f"{type(exc).__name__}: {exc}")
            raise self._failed(exc, job.src, "read") from None
        self.transfers.finished(job.transfer)
        err = self._arrive(b, job.src, job.dst, job.slot, got)
        if err is not None:
            raise err
        self.prefetched.add(b.id)
        self.moved.setdefault((job.src, job.dst), [0, 0.0])[0] += 1  # copy time overlapped: not counted

    def try_settle(self, b: Block) -> bool:
        """``settle`` ``b``'s prefetch if one is in flight, where a bad or failed copy is no error for the caller:
        it was discarded (recorded as ``checksum_error`` or ``io_error``, its slot freed) and the block stays
        where it was. False when that happened."""
        if b.inflight is None:
            return True
        if b.inflight.transfer.gate is not None and not b.inflight.future.done():
            self._abandon(b)
            return False
        try:
            self.settle(b)
        except (ChecksumMismatch, StorageError):
            return False
        return True

    def _abandon(self, b: Block) -> None:
        """free-during-prefetch: ``b``'s copy still in flight is not waited for: its reserved slot goes back to the
        pool while the copy will still land there, and its transfer is never closed (the fault)."""
        job: _Inflight = b.inflight
        b.inflight = None
        del self.inflight[b.id]
        self.pool.slots[job.dst].give(job.slot)
        self.transfers.abandon(job.transfer)
        if self.faults.hit is None:
            self.faults.fired(b.id, b.owners[0] if b.owners else None, None, self.bus.step)

    def poll(self) -> None:
        """Book every prefetch that has finished (a bad or failed copy stays behind; its next swap-in reports it)."""
        self.transfers.release()
        for b in [b for b in self.inflight.values() if b.inflight.future.done()]:
            self.try_settle(b)

    def drain(self) -> None:
        """Wait for every copy in flight without booking it (before an arena reallocates)."""
        self.transfers.release(every=True)
        wait([b.inflight.future for b in self.inflight.values()])  # a failed copy is booked when settled

    @property
    def hit_rate(self) -> float | None:
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else None

    def close(self) -> None:
        self.drain()  # no copy left held at a gate (free-during-prefetch) when the worker is shut down
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
