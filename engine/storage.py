"""The only place that allocates KV memory: arenas per tier, one per codec the tier holds.

Layout, the same in every arena: slot ``s`` holds one block as ``(L, H, R)``
elements, where row ``(l, h)`` is that head's K (``block_size x head_dim``) then
its V, padded to 128 bytes (``EngineConfig.row_elems``). Keeping a head's K and V
together makes a block one contiguous run of bytes, so a tier move is a slice
copy and a checksum is one reduction.

Arenas grow by ``chunk_blocks`` up to their capacity and never shrink; freed slots
are reused by the pool. The device and host arenas are a single tensor (growth
copies it, a rare event, so paged attention can index one tensor); the disk arena
is one memory-mapped file per chunk in a private directory, so it grows without
copying and a full disk fails at growth (the file is preallocated) rather than
with a SIGBUS in the middle of a swap.

A tier holds blocks of several codecs when its blocks may arrive lossier than its
own codec (a block that went to disk as nf4 comes back to the device as nf4), so
each tier has one arena per codec (``TierArenas``), the tier's own created at once
and the others on first use. A slot number names its arena as well:
``slot = index << shift | local``, index 0 being the tier's own codec, so a tier
that only ever holds its own codec has exactly the slots it would have alone.
"""

from __future__ import annotations

import errno as _errno
import mmap
import os
import shutil
import tempfile
import weakref
from typing import Iterator

import numpy as np
import torch

from .config import EngineConfig, Tier
from .errors import StorageError

__all__ = ["Arena", "TensorArena", "DiskArena", "TierArenas", "make_arena", "runs"]


def runs(src: list[int], dst: list[int], src_chunk: int, dst_chunk: int) -> Iterator[tuple[int, int, int]]:
    """Split parallel slot lists into ``(src_start, dst_start, length)`` runs that are
    consecutive on both sides and stay inside one chunk of each arena, so each run is
    one slice copy."""
    n = len(src)
    i = 0
    while i < n:
        s0, d0 = src[i], dst[i]
        j = i + 1
        while (
            j < n
            and src[j] == s0 + (j - i)
            and dst[j] == d0 + (j - i)
            and src[j] % src_chunk != 0
            and dst[j] % dst_chunk != 0
        ):
            j += 1
        yield s0, d0, j - i
        i = j


class Arena:
    """Slots of one tier. ``view(start, n)`` is the only way at the bytes: an ``(n, L, H, R)``
    tensor aliasing slots ``start … start+n-1`` (which must lie in one chunk)."""

    tier: str
    device: torch.device

    def __init__(self, tier: str, config: EngineConfig, codec: str | None = None) -> None:
        self.tier = tier
        self.config = config
        self.codec = codec or config.tier_codec(tier)
        self.layout = config.layout(self.codec)
        self.dtype = self.layout.torch_dtype
        self.bytes_per_block = self.layout.bytes_per_block
        self.capacity = config.capacity(tier)  # any one codec may come to hold the whole tier
        self.num_slots = 0  # slots grown so far
        self.block_shape = (config.num_layers, config.num_kv_heads, self.layout.row_elems)
        self.chunk = config.chunk_blocks  # slots per contiguous piece (see ``runs``)

    def grow(self) -> range:
        """Add up to ``chunk_blocks`` slots (never past capacity); returns the new slot ids."""
        raise NotImplementedError

    def view(self, start: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def layer_rows(self, layer: int, slots: list[int]) -> torch.Tensor:
        """``(n, H, R)``: one layer's rows of the blocks at local ``slots`` (long context reads a slower tier's
        blocks a layer at a time into the device staging area), one gather per chunk of the arena."""
        chunk = self.chunk
        by_chunk: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            by_chunk.setdefault(s // chunk, []).append(i)
        if len(by_chunk) == 1:
            (c, idx), = by_chunk.items()
            base = self.view(c * chunk, min(chunk, self.num_slots - c * chunk))[:, layer]  # (m, H, R)
            return base.index_select(0, torch.tensor([slots[i] - c * chunk for i in idx]))
        out = torch.empty((len(slots), *self.block_shape[1:]), dtype=self.dtype)
        for c, idx in by_chunk.items():
            base = self.view(c * chunk, min(chunk, self.num_slots - c * chunk))[:, layer]
            out[torch.tensor(idx)] = base.index_select(0, torch.tensor([slots[i] - c * chunk for i in idx]))
        return out

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    def close(self) -> None:
        """Give the memory back; the arena is unusable afterwards."""


class TensorArena(Arena):
    """Device or host memory as one tensor ``(num_slots, L, H, R)``.

    The host arena is pinned when CUDA is present, so copies to the device can be
    asynchronous. Growth copies the tensor once per chunk; callers must not hold
    views across a ``grow`` (the cache drains in-flight copies before growing).
    """

    def __init__(self, tier: str, config: EngineConfig, device: str, codec: str | None = None) -> None:
        super().__init__(tier, config, codec)
        self.device = torch.device(device)
        self.pin = tier == Tier.HOST and torch.cuda.is_available()
        self.chunk = max(self.capacity, 1)  # one contiguous piece: runs never break on chunks
        self.data = self._empty(0)

    def _empty(self, n: int) -> torch.Tensor:
        try:
            return torch.empty((n, *self.block_shape), dtype=self.dtype, device=self.device,
                               pin_memory=self.pin)
        except (RuntimeError, MemoryError) as exc:  # torch reports CUDA/host OOM as RuntimeError
            raise StorageError(self.tier, f"grow to {n} blocks", _errno.ENOMEM, None, str(exc).splitlines()[0]) from exc

    def grow(self) -> range:
        old = self.num_slots
        new = min(self.capacity, old + self.config.chunk_blocks)
        if new == old:
            return range(old, old)
        data = self._empty(new)
        # Never-written memory may hold NaN bit patterns; masked key slots (a partial block's
        # tail, padding rows) still meet V in probs @ v, and 0 * NaN is NaN.
        data[old:].zero_()
        if old:
            data[:old].copy_(self.data)
        self.data, self.num_slots = data, new
        return range(old, new)

    def view(self, start: int, n: int) -> torch.Tensor:
        return self.data[start : start + n]

    def layer_kv(self, layer: int) -> torch.Tensor:
        """``(num_slots, H, 2, block_size, D)`` alias of one layer: index ``[:, :, 0]`` is K, ``[:, :, 1]`` V."""
        c = self.config
        return self.data[:, layer, :, : 2 * c.block_size * c.head_dim].unflatten(-1, (2, c.block_size, c.head_dim))

    def close(self) -> None:
        self.data = self._empty(0)
        self.num_slots = 0


class DiskArena(Arena):
    """Memory-mapped spill files, one per chunk, in a private directory (0700, files 0600).

    Each chunk file is preallocated with ``posix_fallocate`` so that a full disk is
    reported as ``StorageError`` when the arena grows, never as a fault while a swap
    writes through the mapping. ``close`` unmaps and deletes the directory.
    """

    def __init__(self, tier: str, config: EngineConfig, codec: str | None = None) -> None:
        super().__init__(tier, config, codec)
        self.device = torch.device("cpu")
        try:
            self.dir = tempfile.mkdtemp(prefix="kvdoctor-spill-", dir=config.disk_dir)  # mode 0700
        except OSError as exc:
            raise StorageError(tier, "create its spill directory", exc.errno, config.disk_dir or tempfile.gettempdir(),
                               exc.strerror or str(exc)) from exc
        self._maps: list[mmap.mmap] = []
        self._chunks: list[torch.Tensor] = []
        # spill files must not outlive the process even if nobody calls close()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)

    def path(self, chunk: int) -> str:
        return os.path.join(self.dir, f"chunk-{chunk:05d}.kv")

    def grow(self) -> range:
        old = self.num_slots
        n = min(self.capacity, old + self.chunk) - old
        if n <= 0:
            return range(old, old)
        path = self.path(len(self._chunks))
        size = n * self.bytes_per_block
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StorageError(self.tier, "create a spill file", exc.errno, path, exc.strerror or str(exc)) from exc
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise StorageError(self.tier, f"reserve {size} bytes", exc.errno, path, exc.strerror or str(exc)) from exc
        os.close(fd)  # the mapping keeps the file open
        raw = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self._maps.append(mm)
        self._chunks.append(raw.view(self.dtype).view(n, *self.block_shape))
        self.num_slots = old + n
        return range(old, old + n)

    def view(self, start: int, n: int) -> torch.Tensor:
        c, off = divmod(start, self.chunk)
        return self._chunks[c][off : off + n]

    def cut_short(self, slots: list[int], restore: bool = True) -> list[int]:
        """Slots whose bytes are gone because a spill file holding one of ``slots`` was cut short under the
        engine (every slot past the new end of that file, not only those asked about); with ``restore`` the
        file is extended back to its size, so the mapping never faults (SIGBUS) on those pages again: they
        read as zeros. (Without, it only looks: a prefetch thread must not hide a cut from the bookkeeping.)

        An fstat per chunk asked about, so it is called before a move touches the disk, not per read. An
        unlinked file is no loss: the mapping keeps its inode and bytes until ``close``."""
        lost: list[int] = []
        for c in sorted({s // self.chunk for s in slots}):
            mm = self._maps[c]
            size = mm.size()  # fstat on the mapping's own descriptor
            if size >= len(mm):
                continue
            start = c * self.chunk
            lost.extend(range(start + size // self.bytes_per_block, start + len(mm) // self.bytes_per_block))
            if not restore:
                continue
            try:
                os.truncate(self.path(c), len(mm))
            except OSError as exc:
                raise StorageError(self.tier, "restore a spill file cut short", exc.errno, self.path(c),
                                   exc.strerror or str(exc)) from exc
            if mm.size() < len(mm):  # the name now points elsewhere: the mapped file cannot be reached
                raise StorageError(self.tier, "restore a spill file cut short", None, self.path(c),
                                   "the file was replaced")
        return lost

    def close(self) -> None:
        self._chunks.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
        self._maps.clear()
        self.num_slots = 0
        self._cleanup()


def make_arena(tier: str, config: EngineConfig, codec: str | None = None) -> Arena:
    if tier == Tier.DEVICE:
        return TensorArena(tier, config, config.device, codec)
    if tier == Tier.HOST:
        return TensorArena(tier, config, "cpu", codec)
    return DiskArena(tier, config, codec)


class TierArenas:
    """One tier's arenas, one per codec it can hold (``EngineConfig.arena_codecs``), the tier's own
    (index 0, the *primary*) made at once and the others on first use. Slot numbers carry the arena:
    ``slot = index << shift | local`` (see the module's docstring)."""

    def __init__(self, tier: str, config: EngineConfig) -> None:
        self.tier = tier
        self.codecs = config.arena_codecs(tier)
        self.shift = max(config.capacity(tier), 1).bit_length()  # every local slot is below 1 << shift
        self.mask = (1 << self.shift) - 1
        self._config = config
        self.arenas: list[Arena | None] = [make_arena(tier, config, self.codecs[0])] + [None] * (len(self.codecs) - 1)

    @property
    def primary(self) -> Arena:
        return self.arenas[0]  # type: ignore[return-value]

    def index(self, codec: str) -> int:
        """Arena index of ``codec`` in this tier (a codec the tier cannot hold is a bug: assert)."""
        assert codec in self.codecs, f"tier {self.tier} holds {self.codecs}, not {codec}"
        return self.codecs.index(codec)

    def get(self, index: int) -> Arena:
        """The arena of ``index``, made on first use (it grows only when a slot is taken)."""
        a = self.arenas[index]
        if a is None:
            a = self.arenas[index] = make_arena(self.tier, self._config, self.codecs[index])
        return a

    def at(self, slot: int) -> tuple[Arena, int]:
        """The arena holding ``slot`` and the slot's number inside it."""
        return self.get(slot >> self.shift), slot & self.mask

    def slot(self, index: int, local: int) -> int:
        return index << self.shift | local

    def made(self) -> list[Arena]:
        return [a for a in self.arenas if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.made())

    def close(self) -> None:
        for a in self.made():
            a.close()
