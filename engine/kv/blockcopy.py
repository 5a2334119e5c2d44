"""Copying blocks' bytes between arenas: runs of neighbouring slots in one transfer, checksums in the same pass.

The primitives ``tiers`` moves blocks with (and benchmarks time): they know arenas and slots, never
the pool, the events or a block's owners.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from .checksum import copy_sum, sum64 as _sum64
from .codecs import Codec
from .storage import Arena, DiskArena, runs

__all__ = ["ArenaPair", "arena_pairs", "copy_pairs", "copy_slots", "transcode"]

# Two arenas, the local slots to copy from the one into the other, and their positions in the callers' lists
ArenaPair = tuple[Arena, list[int], Arena, list[int], list[int]]


def arena_pairs(src: Any, src_slots: list[int], dst: Any, dst_slots: list[int]) -> list[ArenaPair]:
    """Tier slots of two tiers' arena sets (``storage.TierArenas``) grouped per (source arena, destination arena),
    as the batches ``copy_pairs`` copies."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for i, (s_, d_) in enumerate(zip(src_slots, dst_slots)):
        pairs.setdefault((s_ >> src.shift, d_ >> dst.shift), []).append(i)
    return [(src.get(si), [src_slots[i] & src.mask for i in idx], dst.get(di), [dst_slots[i] & dst.mask for i in idx],
             idx) for (si, di), idx in pairs.items()]


def copy_pairs(pairs: list[ArenaPair], n: int, *, checksum: bool, non_blocking: bool = False) -> list[int | None]:
    """``copy_slots`` for each arena pair; the checksums of the ``n`` copied blocks in their callers' order."""
    out: list[int | None] = [None] * n
    for sa, s_, da, d_, idx in pairs:
        for i, c in zip(idx, copy_slots(sa, s_, da, d_, checksum=checksum, non_blocking=non_blocking)):
            out[i] = c
    return out


def copy_slots(
    src: Arena, src_slots: list[int], dst: Arena, dst_slots: list[int], *, checksum: bool = False,
    non_blocking: bool = False,
) -> list[int | None]:
    """Copy blocks slot by slot: between memory arenas one slice copy per run of slots neighbouring on both
    sides; to or from the disk one transfer per run of neighbouring *disk* slots (``_disk_copy``).

    With ``checksum``, returns each copied block's checksum (in the order given), taken in the
    same pass as the copy wherever the bytes pass through the CPU (``checksum.copy_sum``). On a
    GPU the sum is taken where the copy landed.
    """
    if isinstance(dst, DiskArena) or isinstance(src, DiskArena):
        return _disk_copy(src, src_slots, dst, dst_slots, checksum)
    order = sorted(range(len(src_slots)), key=src_slots.__getitem__)
    s = [src_slots[i] for i in order]
    d = [dst_slots[i] for i in order]
    sums: dict[int, int] = {}
    for s0, d0, n in runs(s, d, src.chunk, dst.chunk):
        out, inp = dst.view(d0, n), src.view(s0, n)
        if out.device.type == "cpu" and inp.device.type == "cpu":
            # one memcpy-speed pass; torch's parallel copy stalls on a busy machine for batches this size
            if checksum:
                sums.update(zip(range(d0, d0 + n), copy_sum(_rows(out), _rows(inp))))
            else:
                np.copyto(_rows(out), _rows(inp))
        else:
            out.copy_(inp, non_blocking=non_blocking)
            if checksum:
                sums.update(zip(range(d0, d0 + n), _sum64(out)))
    return [sums.get(x) for x in dst_slots]


def _disk_copy(src: Arena, src_slots: list[int], dst: Arena, dst_slots: list[int], checksum: bool
               ) -> list[int | None]:
    """``copy_slots`` to or from the disk: runs follow the disk's slots alone, so blocks scattered in memory
    still make one large transfer, gathered into (or scattered from) it in the pass that takes the checksum.
    A GPU's blocks go through host memory."""
    write = isinstance(dst, DiskArena)
    disk, mem = (dst, src) if write else (src, dst)
    assert not isinstance(mem, DiskArena), "disk to disk is no tier move"
    disk_slots, mem_slots = (dst_slots, src_slots) if write else (src_slots, dst_slots)
    whole = mem.view(0, mem.num_slots)  # a memory arena is one tensor: (num_slots, L, H, R)
    host = _rows(whole) if whole.device.type == "cpu" else None
    out: list[int | None] = [None] * len(disk_slots)
    for k0, at in _disk_runs(disk, disk_slots):
        slots, n = [mem_slots[j] for j in at], len(at)
        if host is not None:  # a 2-D slice where the memory slots neighbour too, else the blocks' rows
            rows = host[slots[0] : slots[0] + n] if slots == list(range(slots[0], slots[0] + n)) \
                else [host[m] for m in slots]
            got = disk.write(k0, rows, checksum=checksum) if write else disk.read(k0, rows, checksum=checksum)
        else:
            idx = torch.tensor(slots, device=whole.device)
            if write:
                got = disk.write(k0, _rows(whole.index_select(0, idx).cpu()), checksum=checksum)
            else:
                staged = torch.empty((n, *whole.shape[1:]), dtype=whole.dtype)  # (n, L, H, R) in host memory
                got = disk.read(k0, _rows(staged), checksum=checksum)
                whole[idx] = staged.to(whole.device)
        if got is not None:
            for j, c in zip(at, got):
                out[j] = c
    return out


def _disk_runs(disk: DiskArena, disk_slots: list[int]) -> Iterator[tuple[int, list[int]]]:
    """The runs of neighbouring ``disk_slots`` (within a spill file), each as its first slot and the positions
    in ``disk_slots`` of its slots, in slot order: one disk transfer each."""
    order = sorted(range(len(disk_slots)), key=disk_slots.__getitem__)
    ks = [disk_slots[i] for i in order]
    i = 0
    for k0, _, n in runs(ks, ks, disk.chunk, disk.chunk):
        yield k0, order[i : i + n]
        i += n


def _rows(blocks: torch.Tensor) -> np.ndarray:
    """``(n, bytes_per_block)`` uint8 numpy view of ``n`` whole blocks in host memory (no copy)."""
    return blocks.view(torch.uint8).numpy().reshape(blocks.shape[0], -1)


def transcode(src: Arena, src_slots: list[int], src_codec: Codec, dst: Arena, dst_slots: list[int],
              dst_codec: Codec, *, checksum: bool = False) -> list[int | None]:
    """Re-encode blocks from ``src`` (held in ``src_codec``) into ``dst`` (in ``dst_codec``), one layer at a
    time over the whole batch; with ``checksum``, each new block's checksum, taken from the destination.

    The arithmetic runs where the source is (the GPU for a device block going down), and only the
    re-encoded, smaller rows cross to the destination."""
    n, L = len(src_slots), src.config.num_layers
    staged = torch.stack([src.view(s, 1)[0] for s in src_slots])  # (n, L, H, R_src)
    out = torch.empty((n, *dst.block_shape), dtype=dst.dtype, device=src.device)  # (n, L, H, R_dst)
    for layer in range(L):
        layers = torch.full((n,), layer, dtype=torch.long, device=src.device)
        k, v = src_codec.read(staged[:, layer], layer)  # (n, H, bs, D) each
        out[:, layer] = dst_codec.encode_rows(k, v, layers, dst.block_shape[-1])
    sums: list[int | None] = [None] * n
    if isinstance(dst, DiskArena):  # one transfer per run of neighbouring disk slots, as for a plain copy
        rows = _rows(out.cpu())
        for k0, at in _disk_runs(dst, dst_slots):
            for j, c in zip(at, dst.write(k0, [rows[j] for j in at], checksum=checksum) or ()):
                sums[j] = c
        return sums
    for i, d in enumerate(dst_slots):
        view = dst.view(d, 1)
        view.copy_(out[i : i + 1])
        if checksum:
            sums[i] = _sum64(view)[0]
    return sums
