"""The only place that allocates KV memory: arenas per tier, one per codec the tier holds.

Layout, the same in every arena: slot ``s`` holds one block as ``(L, H, R)``
elements, where row ``(l, h)`` is that head's K (``block_size x head_dim``) then
its V, padded to 128 bytes (``EngineConfig.row_elems``). Keeping a head's K and V
together makes a block one contiguous run of bytes, so a tier move is a slice
copy (or one disk transfer) and its checksum is taken in the same pass.

Arenas grow by ``chunk_blocks`` up to their capacity and never shrink; freed slots
are reused by the pool. The device and host arenas are a single tensor (growth
copies it, a rare event, so paged attention can index one tensor); the disk arena
is one preallocated spill file per chunk in a private directory, read and written
with O_DIRECT where the filesystem allows (``DiskArena``), so it grows without
copying and a full disk fails at growth rather than with a SIGBUS or ENOSPC in the
middle of a swap.

A tier holds blocks of several codecs when its blocks may arrive lossier than its
own codec (a block that went to disk as nf4 comes back to the device as nf4), so
each tier has one arena per codec (``TierArenas``), the tier's own created at once
and the others on first use. A slot number names its arena as well:
``slot = index << shift | local``, index 0 being the tier's own codec, so a tier
that only ever holds its own codec has exactly the slots it would have alone.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any, Iterator

import numpy as np
import torch

from ..config import EngineConfig, Tier
from ..errors import StorageError
from .checksum import copy_sum, sum64_rows

__all__ = ["Arena", "TensorArena", "DiskArena", "TierArenas", "make_arena", "runs", "DISK_ALIGN", "IO_PIECE"]

DISK_ALIGN = 4096  # O_DIRECT wants file offsets, lengths and buffer addresses aligned to the device's block
IO_PIECE = 8 << 20  # bytes per disk call: large sequential transfers, yet a piece's checksum reads from cache
Blocks = np.ndarray | list[np.ndarray]  # whole blocks as uint8: (n, bytes_per_block), or n rows from anywhere


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
            # An arena first grown inside the runner's forward (inference mode) must stay an ordinary tensor:
            # swaps outside it write into it (an inference tensor refuses in-place updates there).
            with torch.inference_mode(False):
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
    """Spill files, one per chunk, in a private directory (0700, files 0600), written and read with
    ``O_DIRECT`` where the filesystem takes it.

    *Layout.* Slot ``s`` of a chunk starts at byte ``s * stride`` of its file, ``stride`` being the
    block's bytes rounded up to ``DISK_ALIGN`` (4 KiB), so every block can be moved by direct I/O.

    *I/O.* ``write`` and ``read`` move a run of neighbouring slots in calls of up to ``IO_PIECE`` bytes:
    a swap of many blocks becomes a few large sequential transfers. With ``O_DIRECT`` (``io ==
    "direct"``) the kernel moves the bytes between the device and an aligned bounce buffer (one per
    thread: the prefetch worker and the caller may move at once) without the page cache, and the one CPU
    pass, bounce to arena or back, takes the checksum on the way (``checksum.copy_sum``). Where the
    filesystem refuses ``O_DIRECT`` (some overlay and network filesystems, older tmpfs) the arena finds
    out by trying once, at creation, in its directory, and falls back to buffered ``pread``/``pwrite``
    straight into the caller's rows; ``config.disk_io`` forces either mode.

    *Views.* ``view`` maps the files, for the few accesses that are not bulk moves (content digests, the
    long-context staging area's per-layer reads, faults and tests). Those go through the page cache;
    Linux keeps them coherent with direct I/O (a direct write drops the cached pages of its range,
    mapped ones included; a direct read first writes back dirty ones), and distinct slots never share a
    page, so a move on one thread never races a view of another slot.

    Each chunk file is preallocated with ``posix_fallocate`` so that a full disk is reported as
    ``StorageError`` when the arena grows, never as a fault (``SIGBUS`` through the mapping, ``ENOSPC``
    from a write) in the middle of a swap. Each chunk keeps its file open (one descriptor next to its one
    mapping), so a spill file deleted under the engine keeps working, as a mapping alone did. ``close``
    closes, unmaps and deletes the directory.
    """

    def __init__(self, tier: str, config: EngineConfig, codec: str | None = None) -> None:
        super().__init__(tier, config, codec)
        self.device = torch.device("cpu")
        self.stride = -(-self.bytes_per_block // DISK_ALIGN) * DISK_ALIGN  # file bytes per slot
        try:
            self.dir = tempfile.mkdtemp(prefix="kvdoctor-spill-", dir=config.disk_dir)  # mode 0700
        except OSError as exc:
            raise StorageError(tier, "create its spill directory", exc.errno, config.disk_dir or tempfile.gettempdir(),
                               exc.strerror or str(exc)) from exc
        self._maps: list[mmap.mmap] = []
        self._chunks: list[torch.Tensor] = []
        self._fds: list[int] = []  # one per chunk, opened in ``io`` mode
        self._local = threading.local()  # per-thread bounce buffer (direct I/O)
        # spill files must not outlive the process even if nobody calls close()
        self._cleanup = weakref.finalize(self, _remove, self.dir, self._fds)
        self.io = self._choose_io(config.disk_io)

    def _choose_io(self, wanted: str) -> str:
        """``"direct"`` if the spill directory takes an aligned ``O_DIRECT`` read (tried on a sparse probe file,
        so a full disk does not decide it), else ``"buffered"``; ``wanted="direct"`` makes a refusal an error."""
        if wanted == "buffered":
            return "buffered"
        probe = os.path.join(self.dir, "probe.direct")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
            try:
                if not getattr(os, "O_DIRECT", 0):
                    raise OSError(_errno.EOPNOTSUPP, "O_DIRECT is not available on this platform")
                os.ftruncate(fd, DISK_ALIGN)
                os.preadv(fd, [_aligned(DISK_ALIGN)], 0)
            finally:
                os.close(fd)
        except OSError as exc:
            if wanted == "direct" or exc.errno not in _NO_DIRECT:
                raise StorageError(self.tier, "use O_DIRECT", exc.errno, self.dir, exc.strerror or str(exc)) from exc
            return "buffered"
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)
        return "direct"

    def path(self, chunk: int) -> str:
        return os.path.join(self.dir, f"chunk-{chunk:05d}.kv")

    def grow(self) -> range:
        old = self.num_slots
        n = min(self.capacity, old + self.chunk) - old
        if n <= 0:
            return range(old, old)
        path = self.path(len(self._chunks))
        size = n * self.stride
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StorageError(self.tier, "create a spill file", exc.errno, path, exc.strerror or str(exc)) from exc
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
            if self.io == "direct":
                io_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
                os.close(fd)
            else:
                io_fd = fd
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise StorageError(self.tier, f"reserve {size} bytes", exc.errno, path, exc.strerror or str(exc)) from exc
        with torch.inference_mode(False):  # as TensorArena._empty: ordinary tensors, wherever the chunk is made
            raw = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8)).view(n, self.stride)[:, : self.bytes_per_block]
            chunk = raw.view(self.dtype).view(n, *self.block_shape)  # (n, L, H, R), rows ``stride`` apart
        self._maps.append(mm)
        self._fds.append(io_fd)
        self._chunks.append(chunk)
        self.num_slots = old + n
        return range(old, old + n)

    def view(self, start: int, n: int) -> torch.Tensor:
        c, off = divmod(start, self.chunk)
        return self._chunks[c][off : off + n]

    def write(self, start: int, rows: Blocks, *, checksum: bool = False) -> list[int] | None:
        """Store ``rows`` (whole blocks as uint8: an ``(n, bytes_per_block)`` array, or a list of ``n`` block rows
        gathered from anywhere) in slots ``start … start+n-1`` (one chunk); with ``checksum``, each block's
        checksum, taken in the same pass."""
        return self._move(start, rows, checksum, write=True)

    def read(self, start: int, rows: Blocks, *, checksum: bool = False) -> list[int] | None:
        """Load slots ``start … start+n-1`` (one chunk) into ``rows`` (as for ``write``: an array, or a list of
        block rows to scatter into); with ``checksum``, each block's checksum, taken in the same pass."""
        return self._move(start, rows, checksum, write=False)

    def _move(self, start: int, rows: Blocks, checksum: bool, *, write: bool) -> list[int] | None:
        c, off = divmod(start, self.chunk)
        n, bpb = len(rows), self.bytes_per_block
        assert all(r.shape == (bpb,) and r.dtype == np.uint8 for r in rows) and off + n <= self._chunk_len(c), (
            f"{n} rows at slot {start}: chunk {c} holds {self._chunk_len(c)} slots of {bpb} uint8")
        fd, per = self._fds[c], max(1, min(IO_PIECE // self.stride, _IOV_MAX // 2))
        sums: list[int] = []
        for i in range(0, n, per):
            part = rows[i : i + per]
            pos = (off + i) * self.stride
            try:
                if self.io == "direct":  # through the aligned bounce buffer, the checksum taken in the copy
                    bounce = self._bounce(per)[: len(part)]  # (m, stride)
                    if write:
                        sums += _copy_rows(bounce[:, :bpb], part, checksum, keep=True)  # the write reads it next
                        _transfer(os.pwritev, fd, [bounce], pos)
                    else:
                        _transfer(os.preadv, fd, [bounce], pos)
                        sums += _copy_rows(part, bounce[:, :bpb], checksum)
                else:  # the kernel copies through the page cache; the sum reads the piece from cache
                    buffers = self._iovecs(part)
                    if write:
                        sums += _sum_rows(part) if checksum else []
                        _transfer(os.pwritev, fd, buffers, pos)
                    else:
                        _transfer(os.preadv, fd, buffers, pos)
                        sums += _sum_rows(part) if checksum else []
            except OSError as exc:
                op = f"{'write' if write else 'read'} {len(part) * self.stride} bytes at offset {pos}"
                raise StorageError(self.tier, op, exc.errno, self.path(c), exc.strerror or str(exc)) from exc
        return sums if checksum else None

    def _chunk_len(self, c: int) -> int:
        return self._chunks[c].shape[0]

    def _iovecs(self, part: Blocks) -> list[Any]:
        """Buffers for one vectored call over ``part``'s slots: the rows, and a pad after each where the
        stride is longer than a block (buffered I/O needs no alignment, so no bounce copy either)."""
        if self.stride == self.bytes_per_block:
            return [part] if isinstance(part, np.ndarray) and part.flags.c_contiguous else list(part)
        pad = self._pad()
        return [x for row in part for x in (row, pad)]

    def _pad(self) -> np.ndarray:
        pad = getattr(self._local, "pad", None)
        if pad is None:  # what reads of the padding land in, and what writes of it store (zeros)
            pad = self._local.pad = np.zeros(self.stride - self.bytes_per_block, dtype=np.uint8)
        return pad

    def _bounce(self, n: int) -> np.ndarray:
        """``(n, stride)`` uint8 on a 4 KiB boundary, kept per thread."""
        b = getattr(self._local, "bounce", None)
        if b is None or b.shape[0] < n:
            b = self._local.bounce = _aligned(n * self.stride).reshape(n, self.stride)
        return b

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
            alive = (size - self.bytes_per_block) // self.stride + 1 if size >= self.bytes_per_block else 0
            lost.extend(range(start + alive, start + len(mm) // self.stride))
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


_IOV_MAX = 1024  # buffers per vectored call (Linux's limit): a padded slot takes two
_NO_DIRECT = (_errno.EINVAL, _errno.EOPNOTSUPP, _errno.ENOTSUP)  # how a filesystem says it has no O_DIRECT


def _aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed uint8 starting on a page (4 KiB) boundary: an anonymous mapping."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def _copy_rows(dst: Blocks, src: Blocks, checksum: bool, keep: bool = False) -> list[int]:
    """Copy whole blocks (arrays: one call; lists of rows: one per block); their checksums with ``checksum``
    (``keep``: ``dst`` is read next, ``checksum.copy_sum``'s)."""
    pairs = ([(dst, src)] if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray)
             else [(d[None], s_[None]) for d, s_ in zip(dst, src)])
    sums: list[int] = []
    for d, s_ in pairs:
        if checksum:
            sums += copy_sum(d, s_, keep=keep)
        else:
            np.copyto(d, s_)
    return sums


def _sum_rows(rows: Blocks) -> list[int]:
    return sum64_rows(rows) if isinstance(rows, np.ndarray) else [sum64_rows(r[None])[0] for r in rows]


def _transfer(call: Any, fd: int, buffers: list[Any], pos: int) -> None:
    """One vectored ``pwritev``/``preadv`` of ``buffers`` at ``pos``. On a preallocated regular file it moves
    every byte or fails; anything less (the file shorter than the arena thinks) is reported as EIO."""
    want = sum(memoryview(b).nbytes for b in buffers)
    done = call(fd, buffers, pos)
    if done != want:
        raise OSError(_errno.EIO, f"moved {done} of {want} bytes")


def _remove(path: str, fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
    shutil.rmtree(path, ignore_errors=True)


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
