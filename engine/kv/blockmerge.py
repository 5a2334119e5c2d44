"""The cache's half of token merging (``engine.kv.merge``): rewriting device blocks in place with their similar
adjacent tokens merged, a ``merge`` event for each block that shrank, its version unchanged.

Every block's rows are merged in one batch (the merge walks a block's positions one at a time, so a
step's blocks share each step of the walk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from ...events import Merge
from ..config import Tier
from .merge import SlotCounts, merge_rows

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["merge_blocks"]


def merge_blocks(cache: PagedKVCache, blocks: Iterable[int], threshold: float) -> dict[int, int]:
    """Merge, in place, adjacent tokens of each block whose keys have at least ``threshold`` cosine similarity
    (per layer and KV head). Only for settled device blocks of one owner: the others' readers expect every
    token. Returns the blocks that shrank, each with the (layer, head, slot) rows it gave up."""
    c, bs, device = cache.config, cache.block_size, cache.device
    L, H, D = c.num_layers, c.num_kv_heads, c.head_dim
    group = cache.pool.lookup(blocks)
    for b in group:
        if b.tier != Tier.DEVICE or b.inflight is not None or len(b.owners) != 1:
            raise ValueError(f"merge of block {b.id}: it must be settled on the device with one owner "
                             f"(tier {b.tier}, owners {b.owners})")
    if not group:
        return {}
    n = len(group)
    slots = torch.tensor([b.slot for b in group], dtype=torch.long, device=device)
    k, v = zip(*(cache.reads.read_blocks(layer, slots) for layer in range(L)))  # each (n, H, bs, D)
    ones = torch.ones(L, H, bs, dtype=torch.int16, device=device)
    merged = cache.merged
    looked = [merged.get(b.id) for b in group]
    counts = torch.stack([m.counts if m is not None and m.counts is not None else ones
                          for m in looked])  # (n, L, H, bs)
    mk, mv, mc = merge_rows(torch.stack(k, dim=1).view(n * L * H, bs, D),
                            torch.stack(v, dim=1).view(n * L * H, bs, D), counts.view(n * L * H, bs), threshold)
    mc = mc.view(n, L, H, bs)
    live = (mc > 0).sum(dim=-1)  # (n, L, H)
    shrank = live < (counts > 0).sum(dim=-1)
    todo = [i for i in range(n) if bool(shrank[i].any())]
    for i in set(range(n)) - set(todo):
        merged[group[i].id] = looked[i] or SlotCounts(None)  # looked at: nothing to merge
    if not todo:
        return {}
    changed = [group[i] for i in todo]
    before, bad = cache.mover.verify(changed)
    mk = mk.view(n, L, H, bs, D).to(c.compute_dtype)
    mv = mv.view(n, L, H, bs, D).to(c.compute_dtype)
    off = torch.arange(bs, device=device)
    for i, b in zip(todo, changed):
        arena, local = cache.devs.at(b.slot)
        where = torch.full((bs,), local, dtype=torch.long, device=device)
        for layer in range(L):
            cache.codecs[arena.codec].write(arena.data[:, layer], layer, where, off, mk[i, layer].transpose(0, 1),
                                            mv[i, layer].transpose(0, 1))  # (bs, H, D) each
        b.checksum = None  # its bytes changed: the next move takes a new checksum
        merged[b.id] = SlotCounts(mc[i].clone())
    after = cache.mover.retake(changed)
    out = {}
    for i, b, d, layer, new in zip(todo, changed, before, bad, after):
        out[b.id] = int((counts[i] > 0).sum()) - int(live[i].sum())
        if cache.bus.enabled:
            layers = shrank[i].any(dim=-1).nonzero().squeeze(1).tolist()
            cache.bus.emit(Merge, block=b.id, tier=b.tier, version=b.version, tokens=bs, heads=H, layers=layers,
                           slots=live[i].sum(dim=-1)[layers].tolist(), digest=d, digest_layer=layer, new_digest=new)
    return out
