"""``PagedKVCache``: the engine's KV cache as the model runner, the scheduler and the step features see it.

The runner's step is: ``reserve`` slots for each sequence's new tokens, ``store`` every layer's K/V into
them (``gather`` the sequence's K/V for attention in between), ``commit`` once all layers are stored,
``emit_read`` for what attention read, and ``end_step``. Under memory pressure the cache demotes other
sequences' blocks to slower tiers (and, only when every tier is full, evicts), brings a sequence's
blocks back up when it is used again, and records every state change as a v1 event on ``cache.bus``.

This class is a facade: each concept lives in a part of its own, and the methods here say which.

- ``pool`` (``engine.kv.pool``): blocks, owners and each tier's slot table; ``mover`` (``engine.kv.mover``):
  swaps, prefetch and checksums between tiers; ``seqs`` (``engine.kv.sequences``): the sequences table and
  its lifecycle; ``step``: the clock and the sequences the current step pins until ``end_step``.
- ``writes`` (``engine.kv.writes``) and ``reads`` (``engine.kv.readplan``): the data path, a step reading
  through the one ``ReadPlan`` it gets from ``plan_reads``; ``layout`` (``engine.kv.readplan.RowLayout``): the
  device arena's rows, for callers that write and read it themselves; ``mixed`` (``engine.kv.mixed``): blocks
  of several codecs on the device, and mixed resolution's demotion.
- ``prefix_reuse`` (``engine.kv.prefix_reuse``), ``longctx`` (``engine.kv.longctx``), ``fault_hooks``
  (``engine.kv.faulthooks``), ``usage`` (``engine.kv.cachestats``), and the environment's trace
  (``engine.kv.envtrace``: ``KVDOCTOR_TRACE``).

Callers outside the cache ask it queries (a scheduler plans a step by ``held``, all its requests at once, and
``room``, as vLLM's asks its KV cache manager; ``has_sequence``, ``blocks_of``, ``block``, ``settle``), never its parts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ...events import Header
from ..bus import Bus
from ..config import EngineConfig, Tier
from ..faults import Faults, resolve_fault
from .blockmerge import merge_blocks
from .cachestats import CacheStats
from .codecs import make_codec
from .digest import DigestBook
from .envtrace import EnvTrace, header
from .faulthooks import FaultHooks
from .longctx import LongContextBook
from .merge import SlotCounts
from .mixed import MixedResolution
from .policy import Importance, make_policy
from .pool import Block, BlockPool
from .prefix import PrefixCache
from .prefix_reuse import PrefixReuse
from .readplan import ReadPlan, Reads, RowLayout
from .sequences import Held, SeqState, SequenceTable, StepState
from .staging import StagingArea
from .storage import Arena, TensorArena, TierArenas
from .mover import TierMover
from .writes import Writes

__all__ = ["PagedKVCache"]


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
        self.devs = self.tier_arenas[Tier.DEVICE]
        self.dev: TensorArena = self.arenas[Tier.DEVICE]  # type: ignore[assignment]
        self.device = self.dev.device
        self.layout = RowLayout(self.dev, config.num_layers, config.num_kv_heads, config.head_dim, config.block_size,
                                self.codec.native)
        self.pool = BlockPool(config, self.bus, {t: self._grower(t) for t in config.tiers})
        # side tables of what features know of some blocks, by block id, forgotten when a block goes
        self.importance = Importance()  # the attention mass the hybrid policy and mixed resolution rank by
        self.merged: dict[int, SlotCounts] = {}  # token merging: what it left in a block
        self.pool.track(self.importance.forget)
        self.pool.track(lambda block_id: self.merged.pop(block_id, None))
        self.dev_slots = self.pool.slots[Tier.DEVICE]
        self.step = StepState(long_context=config.long_context)
        self.seqs = SequenceTable(self)
        self.staging = (StagingArea(config, self.tier_arenas, self.codecs, self.device, by_id=self.faults.stale_staging)
                        if config.long_context else None)
        self.prefix: PrefixCache | None = None
        if config.prefix_cache:
            kv = {"codec": "mixed" if config.mixed else config.tier_codec(Tier.DEVICE), "dtype": config.dtype}
            self.prefix = PrefixCache(self.pool, self.block_size, {**config.prefix_salt, **kv}, self.faults)
        self.prefix_reuse = PrefixReuse(self)
        self.mover = TierMover(
            config, self.pool, self.tier_arenas, self.bus, make_policy(config, self.importance), self.faults, self.codecs,
            protected=self.step.protects, evictable=self.seqs.is_evictable, evict=self.seqs.evict,
            distance=self.seqs.distance, clock=lambda: self.step.tick, digests=self.digests,
            reclaim=self.prefix_reuse.reclaim,
        )
        self.writes, self.reads, self.mixed = Writes(self), Reads(self), MixedResolution(self)
        self.longctx, self.fault_hooks, self.usage = LongContextBook(self), FaultHooks(self), CacheStats(self)
        self._trace = EnvTrace(self)
        self._trace.open()  # last: the hooks it calls get the whole cache

    def _grower(self, tier: str) -> Callable[[int], range]:
        arenas = self.tier_arenas[tier]

        def grow(index: int) -> range:
            self.mover.drain()  # a reallocating arena must not have copies landing in the old tensor
            new = arenas.get(index).grow()
            if tier == Tier.DEVICE and index == 0:
                self.layout.forget()
            return new

        return grow

    def header(self) -> Header:
        return header(self)

    def single_codec(self) -> bool:
        """Whether every device block is in the device's own arena (the single-codec data path applies)."""
        return self.dev_slots.used_by[0] == self.dev_slots.used

    # ---- queries (the scheduler and step features ask these) ----
    def has_sequence(self, seq: Any) -> bool:
        return seq in self.seqs

    def sequence(self, seq: Any) -> SeqState:
        """``seq``'s state: its blocks, length and pending writes (read it, never change it)."""
        return self.seqs.require(seq)

    def blocks_of(self, seq: Any) -> list[Block]:
        """``seq``'s present blocks in position order (read them, never change the list)."""
        return self.seqs.require(seq).blocks

    def block(self, block_id: int) -> Block | None:
        """The allocated block ``block_id``, or None."""
        return self.pool.blocks.get(block_id)

    def held(self, seqs: Iterable[Any]) -> dict[Any, Held]:
        """What each of ``seqs`` the cache holds has: its length, its blocks on the device, whether some are away."""
        return self.seqs.held(seqs)

    def free_blocks(self, tier: str) -> int:
        return self.pool.slots[tier].num_free

    def room(self) -> dict[str, int]:
        """Each tier's free blocks, with the prefix cache's that no request holds (it gives them up when asked)."""
        return {t: ts.num_free + self.prefix_reuse.reclaimable(t) for t, ts in self.pool.slots.items()}

    def settle(self, b: Block) -> bool:
        """Land ``b``'s prefetch if one is in flight; False when its copy was bad and discarded (it stays away)."""
        return self.mover.try_settle(b)

    def reclaimable(self, tier: str) -> int:
        """Slots of ``tier`` the prefix cache gives up when room is needed (its blocks no request holds)."""
        return self.prefix_reuse.reclaimable(tier)

    def ownerless_blocks(self) -> set[int]:
        """Blocks no live sequence owns (leaked, or held by the prefix cache alone)."""
        return {b.id for b in self.pool.blocks.values() if not any(o in self.seqs for o in b.owners)}

    def seq_len(self, seq: Any) -> int:
        return self.seqs.require(seq).length

    def version(self, seq: Any) -> int:
        return self.seqs.require(seq).version

    def block_table(self, seq: Any) -> list[int]:
        return [b.id for b in self.seqs.require(seq).blocks]

    def slot_counts(self, seq: Any) -> list[SlotCounts | None]:
        """Token merging: what it left in each of ``seq``'s blocks (position order; None: never looked at)."""
        merged = self.merged
        return [merged.get(b.id) for b in self.seqs.require(seq).blocks]

    def num_tokens(self, seq: Any) -> int:
        """Tokens ``gather`` returns: committed and reserved, less any evicted blocks."""
        return self.seqs.num_tokens(seq)

    def max_step_tokens(self, seq: Any) -> int | None:
        """Long context: the most new tokens ``seq`` may reserve in one step; None: no limit."""
        return self.longctx.max_step_tokens(seq)

    # ---- sequences (engine.kv.sequences) ----
    def add_sequence(self, seq: Any, prompt_len: int = 0, priority: int = 0, adapter: str | None = None) -> None:
        """A new sequence; ``adapter``: what the request runs under besides the model (a LoRA's name), part
        of the prefix cache's salt, so requests under different adapters never share blocks."""
        self.seqs.add(seq, prompt_len, priority, adapter)

    def remove_sequence(self, seq: Any, reason: str = "finished", error: str | None = None) -> None:
        """The sequence leaves: every block it owns is released, and freed when no one else owns it.
        ``error``: the name of the typed error the engine failed it with (``reason`` is then "aborted")."""
        self.seqs.remove(seq, reason, error)

    def fork(self, parent: Any, child: Any) -> None:
        """``child`` starts as a copy of ``parent``'s committed tokens, sharing its blocks."""
        self.seqs.fork(parent, child)

    def adopt(self, seq: Any, source: Any) -> None:
        """``seq`` gives up its own tokens and takes ``source``'s committed ones, keeping its id (beam search's
        reorder). Ownership changes hands and no K/V is copied; a later write into a shared partial block
        copies it first (``reserve``). Both must hold the same number of tokens (``fork`` a new one instead)."""
        self.seqs.adopt(seq, source)

    def rollback(self, seq: Any, n: int) -> None:
        """Discard the last ``n`` committed tokens (rejected speculation); the version advances by ``n``."""
        self.seqs.rollback(seq, n)

    def reuse_prefix(self, seq: Any, tokens: Sequence[int]) -> int:
        """Start ``seq`` (empty, just added) from the longest cached prefix of ``tokens``; returns the tokens
        served, which ``seq`` need not compute (0 without a prefix cache)."""
        return self.prefix_reuse.reuse(seq, tokens)

    # ---- writing (engine.kv.writes) ----
    def reserve(self, seq: Any, n: int) -> torch.Tensor:
        """Device slots for ``seq``'s next ``n`` positions, as a ``(n,)`` LongTensor."""
        return self.writes.reserve(seq, n)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` (each ``(N, H_kv, D)``) for one layer at ``slots`` from ``reserve`` (encoded by the
        codec when it quantizes); while someone listens, what was meant for each slot is staged for the digests."""
        self.writes.store(layer, slots, k, v)

    def store_rows(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Where ``store`` writes each token's K and V heads, as rows of ``head_dim`` elements from ``layer_kv``'s
        start, ordered (K/V, token, head), for a caller that writes them itself and then calls ``stored``. None
        where a store must go through ``store``: codes, blocks in several codecs, a fault that moves rows."""
        return self.writes.store_rows(slots)

    def digest_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The digests' weights (of K and of V ``(H_kv, D)``, of a record's columns ``(L, U)``) while stores are
        recorded, else None: a caller that writes K/V at ``store_rows`` itself sums each token's units by them."""
        return self.writes.digest_weights()

    def stored(self, slots: torch.Tensor, units: np.ndarray, shares: np.ndarray | None = None) -> None:
        """What ``store`` does besides copying, for tokens a caller wrote at ``store_rows(slots)``: staging every
        layer's unit sums ``(L, N)`` of them and their digest shares ``(N, U)`` for the blocks' digests."""
        self.writes.stored(slots, units, shares)

    def commit(self, seq: Any, n: int | None = None, tokens: Sequence[int] | None = None) -> None:
        """The first ``n`` reserved tokens (default: all) are stored in every layer: a ``write`` per block touched;
        the rest are dropped. ``tokens``: their ids, which the prefix cache keys the blocks they fill by."""
        self.writes.commit(seq, n, tokens)

    def recode(self, blocks: Iterable[int], codec: str) -> None:
        """Re-encode device blocks in place to the lossier ``codec`` (engine.kv.mixed)."""
        self.mixed.recode(blocks, codec)

    def merge_tokens(self, blocks: Iterable[int], threshold: float) -> dict[int, int]:
        """Merge similar adjacent tokens of settled single-owner device blocks in place (engine.kv.blockmerge);
        returns the blocks that shrank, each with the (layer, head, slot) rows it gave up."""
        return merge_blocks(self, blocks, threshold)

    # ---- reading (engine.kv.readplan, engine.kv.longctx) ----
    def ensure_resident(self, seqs: Iterable[Any]) -> None:
        """Bring every block of ``seqs`` to the device (pinning them for this step). Raises ``OutOfBlocks`` when
        they cannot all fit, ``ChecksumMismatch`` when a copy coming back is corrupt (the block stays where it was)."""
        self.reads.ensure_resident(seqs)

    def plan_reads(self, seqs: Sequence[Any], q_lens: Sequence[int]) -> ReadPlan:
        """This step's ``ReadPlan``, built once before the forward pass, after ``reserve``: every row's blocks made
        resident (long context: where each is read from), and the block tables and row layout attention reads
        them through. Valid until the step ends."""
        return self.longctx.plan_reads(seqs, q_lens)

    def book_streamed(self, reads: dict[Any, dict[int, tuple[str, int, int]]], device_rows: int, staged_rows: int,
                      *, predict: bool) -> None:
        """After a streamed step's commit: the events of what attention read, and (``predict``) a prefetch."""
        self.longctx.book_streamed(reads, device_rows, staged_rows, predict=predict)

    def slot_table(self, seq: Any) -> torch.Tensor:
        """``(num_blocks,)`` device-arena slots of ``seq``'s blocks in position order (paged attention); brings
        the blocks to the device first if needed. Valid until the step ends."""
        return self.reads.slot_table(seq)

    def layer_kv(self, layer: int) -> torch.Tensor:
        """``(num_slots, H, 2, block_size, D)`` view of the device arena for one layer ([:, :, 0] K, [:, :, 1] V),
        valid until the next allocation. Only for codecs that store the dtype as it is, while every device
        block is in the device's own arena: otherwise a ``ValueError`` says to use ``read_blocks``."""
        return self.reads.layer_kv(layer)

    def read_blocks(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the device-arena ``slots`` (any shape ``S``) for ``layer``, decoded to the compute dtype:
        each ``(*S, H_kv, block_size, D)``; with ``heads`` (shape ``S``) only that KV head of each slot, each
        ``(*S, block_size, D)``. Each block is decoded with its own codec."""
        return self.reads.read_blocks(layer, slots, heads)

    def gather(self, seq: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq``'s cached K and V for ``layer``, each ``(H_kv, T, D)`` on the device, in position order
        (tokens stored but not yet committed included; evicted blocks skipped)."""
        return self.reads.gather(seq, layer)

    def sample_reads(self, seqs: Sequence[Any]) -> list[list[int]] | None:
        """For each of ``seqs``' next reads, the block indices the sampler picks to verify, for a reader that
        digests them in its own pass and hands ``emit_read`` what it found; None unless ``verify="sample"``."""
        return self.reads.sample_reads(seqs)

    def emit_read(self, seq: Any, blocks: Sequence[int] | None = None, layer: int | None = None, *,
                  versions: Sequence[int] | None = None, tiers: Sequence[str] | None = None,
                  checked: Sequence[tuple[int, int]] | None = None) -> None:
        """Record that attention read ``blocks`` of ``seq`` (default: all), with the versions read (default: each
        block's own) and the tier each came from. ``checked``: ``(block index, digest over the bytes read)`` of
        each block ``sample_reads`` picked (none: empty), from a reader that digested them as it read them."""
        self.reads.emit_read(seq, blocks, layer, versions=versions, tiers=tiers, checked=checked)

    def observe_attention(self, seq: Any, layer: int | None, block_scores: Sequence[float] | torch.Tensor) -> None:
        """Feed the hybrid policy: attention mass of ``seq``'s newest query on each of its blocks (position order),
        accumulated with decay. ``layer``: where it was measured, or None for the mean over every layer."""
        s = self.seqs.require(seq)
        scores = block_scores.tolist() if isinstance(block_scores, torch.Tensor) else list(block_scores)
        if len(scores) != len(s.blocks):
            raise ValueError(f"observe_attention for {seq!r}: {len(scores)} scores for {len(s.blocks)} blocks")
        self.importance.observe(s.blocks, scores)

    def score_hook(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the runner passes as ``corrupt=`` to attention at ``layer``: None unless the attention-nan fault
        is on and targets this layer and step."""
        return self.faults.score_hook(layer, self.bus.step)

    # ---- explicit tier moves (engine.kv.mover) ----
    def swap_out(self, blocks: Iterable[int], dst: str = Tier.HOST) -> None:
        if dst not in self.pool.slots or dst == Tier.DEVICE:
            raise ValueError(f"swap_out to {str(dst)!r}: must be one of {', '.join(self.config.tiers[1:])}")
        self.mover.move(self.pool.lookup(blocks), dst)

    def swap_in(self, blocks: Iterable[int]) -> None:
        self.mover.move(self.pool.lookup(blocks), Tier.DEVICE)

    def evict(self, blocks: Iterable[int], reason: str = "importance") -> None:
        """Drop blocks for good, from every owner (importance eviction: H2O, StreamingLLM); an ``evict`` event
        per block. The caller keeps a sequence's newest block: its next token goes there."""
        for b in self.pool.lookup(blocks):
            self.mover.try_settle(b)  # the block is being dropped anyway: a bad copy of it is simply discarded
            self.seqs.evict([b], b.tier, reason)

    def prefetch(self, seq: Any, max_blocks: int | None = None) -> int:
        """Start bringing up to ``prefetch_depth`` (and ``max_blocks``) of ``seq``'s blocks back to the device in
        the background (a scheduler calls this for the sequences it will run next). Returns how many."""
        depth = self.config.prefetch_depth if max_blocks is None else min(self.config.prefetch_depth, max_blocks)
        if depth <= 0:
            return 0
        s = self.seqs.require(seq)
        away = [b for b in s.blocks if b.tier != Tier.DEVICE and b.inflight is None][:depth]
        return self.mover.prefetch(away, Tier.DEVICE, exclude={b.id for b in s.blocks})

    # ---- steps, statistics, closing ----
    def preallocate(self) -> None:
        """Grow every tier's own arena to its capacity now, as a warm engine has it."""
        for slots in self.pool.slots.values():
            slots.grow_fully()

    def end_step(self, num_tokens: int = 0) -> None:
        """Book finished prefetches, emit each tier's usage, close the step on the bus, unpin."""
        self.mover.poll()
        self.usage.end_step()
        counts = self.prefix.end_step() if self.prefix is not None else ()  # the step's prefix hits and misses
        self.bus.end_step(num_tokens, **dict(zip(("prefix_hits", "prefix_misses"), counts)))
        self.digests.end_step()
        self.step.clear()

    # long context's counters, every step so far: bytes staged, (layer, block) reads served on the device or not
    bytes_staged = property(lambda self: self.longctx.bytes_staged)
    rows_from_device = property(lambda self: self.longctx.rows_from_device)
    rows_from_slower = property(lambda self: self.longctx.rows_from_slower)

    def stats(self) -> dict[str, Any]:
        """Occupancy per tier (blocks and the real bytes of each block's codec), tokens, prefetch and swaps."""
        return self.usage.stats()

    def close(self) -> None:
        """Stop the prefetch worker, flush events, close an environment trace, delete spill files."""
        if self._closed:
            return
        self._closed = True
        self.mover.close()
        self._trace.detach()
        self.bus.flush()
        self._trace.close()
        for a in self.tier_arenas.values():
            a.close()

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
