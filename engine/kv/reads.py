"""The cache's read path: bringing a step's sequences to the device, their slot tables, the K/V attention
reads (each block decoded with its codec), and the ``read`` events of what it read, with the digests of
the blocks the sampler picked to verify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from ...events import Read
from ..config import Tier
from ..errors import OutOfBlocks
from .pool import Block

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["Reads"]


class Reads:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    # ---- residency ----
    def ensure_resident(self, seqs: Iterable[Any]) -> None:
        c = self.cache
        ss = [c.seqs.require(q) for q in seqs]
        step, mover = c.step, c.mover
        step.tick += 1
        blocks: dict[int, Block] = {}
        for s in ss:
            step.pinned.add(s.id)
            s.last_access = step.tick
            for b in s.blocks:
                blocks[b.id] = b
        cap = c.pool.slots[Tier.DEVICE].capacity
        if len(blocks) > cap:
            raise OutOfBlocks(Tier.DEVICE, len(blocks), cap)
        missing = []
        for b in blocks.values():
            b.last_access = step.tick
            if b.inflight is not None:
                mover.prefetch_hits += 1
                mover.settle(b)
                b.prefetched = False
            elif b.tier != Tier.DEVICE:
                missing.append(b)
            elif b.prefetched:
                mover.prefetch_hits += 1
                b.prefetched = False
        if missing:
            mover.prefetch_misses += len(missing)
            mover.move(missing, Tier.DEVICE, exclude=set(blocks))
            for s in ss:
                s.index_cache = None

    def slot_table(self, seq: Any) -> torch.Tensor:
        c = self.cache
        s = c.seqs.require(seq)
        cached = s.index_cache
        if cached is not None and cached[0] == c.pool.epoch:
            return cached[1]
        if any(b.tier != Tier.DEVICE or b.inflight is not None for b in s.blocks):
            self.ensure_resident([seq])
        t = torch.tensor([b.slot for b in s.blocks], dtype=torch.long, device=c.device)
        s.index_cache = (c.pool.epoch, t)
        return t

    # ---- K/V ----
    def layer_kv(self, layer: int) -> torch.Tensor:
        c = self.cache
        if not c.codec.native:
            raise ValueError(f"layer_kv is a raw view and the {c.codec.name} codec stores codes: use read_blocks")
        ts = c.pool.slots[Tier.DEVICE]
        if ts.used_by[0] != ts.used:
            held = {name: n for name, n in zip(c.devs.codecs[1:], ts.used_by[1:]) if n}
            raise ValueError(f"layer_kv is a raw view of the device's {c.codec.name} arena, and {ts.used - ts.used_by[0]} "
                             f"device blocks are held in other codecs ({held}): use read_blocks")
        return c.layout.layer_kv(layer)

    def read_rows(self, table: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        try:
            self.layer_kv(0)
        except ValueError:
            return None, 0
        return self.cache.layout.read_rows(table)

    def read_blocks(self, layer: int, slots: torch.Tensor, heads: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        if not c.single_codec():
            return c.mixed.read(layer, slots, heads)
        if heads is None:
            rows = c.dev.data[:, layer].index_select(0, slots.reshape(-1))  # (n, H, R)
            k, v = c.codec.read(rows, layer)  # (n, H, bs, D) each
            return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])
        flat_heads = heads.reshape(-1)
        rows = c.dev.data[:, layer][slots.reshape(-1), flat_heads]  # (n, R)
        k, v = c.codec.read(rows[:, None], layer, flat_heads)  # (n, 1, bs, D) each
        return k.view(*slots.shape, *k.shape[2:]), v.view(*slots.shape, *v.shape[2:])

    def gather(self, seq: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        s = c.seqs.require(seq)
        idx = self.slot_table(seq)
        if layer == 0:
            s.last_access = c.step.tick
        cfg, bs = c.config, c.block_size
        T = c.seqs.num_tokens(seq)
        kb, vb = self.read_blocks(layer, idx)  # (nb, H, bs, D) each
        nb = kb.shape[0]
        k = kb.transpose(0, 1).reshape(cfg.num_kv_heads, nb * bs, cfg.head_dim)[:, :T]  # (H, T, D)
        v = vb.transpose(0, 1).reshape(cfg.num_kv_heads, nb * bs, cfg.head_dim)[:, :T]  # (H, T, D)
        return k, v

    # ---- what was read ----
    def sample_reads(self, seqs: Sequence[Any]) -> list[int] | None:
        c = self.cache
        if not (c.bus.enabled and c.digests.mode == "sample"):
            return None
        picked = [c.digests.sample((s := c.seqs.require(seq)).blocks, s) for seq in seqs]
        return [p[0] if p else -1 for p in picked]

    def emit_read(self, seq: Any, blocks: Sequence[int] | None = None, layer: int | None = None, *,
                  versions: Sequence[int] | None = None, tiers: Sequence[str] | None = None,
                  checked: tuple[int, int | None] | None = None) -> None:
        c = self.cache
        if not c.bus.enabled:
            return
        s = c.seqs.require(seq)
        if blocks is None:
            read = s.blocks
            ids = [b.id for b in read]
            versions = [b.version for b in read]
        else:
            ids = list(blocks)
            read = [c.pool.blocks.get(i) for i in ids]
            versions = list(versions) if versions is not None else [b.version if b is not None else -1 for b in read]
        digests = layers = None
        if checked is None:
            chosen = [i for i in c.digests.sample(read, s) if read[i] is not None]
        else:
            chosen = [checked[0]] if checked[0] >= 0 else []
        if chosen:
            confirmed = checked is not None and self._confirms(read[checked[0]], checked[1])
            got, bad = ([checked[1]], [None]) if confirmed else c.mover.verify([read[i] for i in chosen])
            digests, layers = [None] * len(ids), [None] * len(ids)
            for i, d, lay in zip(chosen, got, bad):
                digests[i], layers[i] = d, lay
            if not any(lay is not None for lay in layers):
                layers = None
        c.bus.emit(Read, seq=seq, blocks=ids, versions=versions, layer=layer, digests=digests, digest_layers=layers,
                   tiers=list(tiers) if tiers is not None else None)

    def _confirms(self, b: Block, digest: int | None) -> bool:
        """Whether ``digest``, taken by a reader over ``b``'s bytes, is its record's: the reader's digest stands.
        Otherwise (no record, a mismatch) ``mover.verify`` looks again, and names the first layer that differs."""
        rec = b.digest
        return rec is not None and rec.codec == b.codec and digest == self.cache.digests.recorded(rec)
