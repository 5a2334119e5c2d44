"""The disk arena's I/O: O_DIRECT where the filesystem takes it, buffered where not (and the trace header
says which), runs of slots moved in few large calls, checksums taken on the way, errors typed."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.kv import checksum
from kvdoctor.engine.kv.checksum import copy_sum, sum64, sum64_rows
from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.errors import StorageError
from kvdoctor.engine.kv.storage import DISK_ALIGN, IO_PIECE, DiskArena, TensorArena
from kvdoctor.engine.kv.blockcopy import copy_slots


def cfg(tmp_path, **kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                device_blocks=8, host_blocks=8, disk_blocks=12, chunk_blocks=6, disk_dir=str(tmp_path))
    base.update(kw)
    return EngineConfig(**base)


def reference_sum(block: bytes) -> int:
    """The checksum's definition, spelled out: the block's little-endian 64-bit words summed modulo 2^64."""
    return sum(int.from_bytes(block[i : i + 8], "little") for i in range(0, len(block), 8)) % (1 << 64)


@pytest.fixture
def no_direct(monkeypatch):
    """A filesystem that refuses O_DIRECT the way tmpfs and some overlays do: EINVAL at open."""
    real_open = os.open

    def refuse(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)


def test_auto_uses_o_direct_where_the_filesystem_takes_it(tmp_path):
    # GIVEN a spill directory on this machine's filesystem WHEN a disk arena grows
    a = DiskArena("disk", cfg(tmp_path))
    a.grow()
    try:
        # THEN its mode says what its file descriptors really are, and slots sit on 4 KiB boundaries
        flags = fcntl.fcntl(a._fds[0], fcntl.F_GETFL)
        assert a.io in ("direct", "buffered") and bool(flags & os.O_DIRECT) == (a.io == "direct")
        assert a.stride % DISK_ALIGN == 0 and a.stride >= a.bytes_per_block
    finally:
        a.close()


def test_a_filesystem_without_o_direct_falls_back_to_buffered_and_the_header_says_so(tmp_path, no_direct, make_cache):
    # GIVEN a filesystem that refuses O_DIRECT WHEN a cache with a disk tier starts
    r = make_cache()
    disk = r.cache.arenas["disk"]
    # THEN the disk arena uses buffered I/O, the trace header says so, and swaps to disk and back work
    assert disk.io == "buffered"
    assert [(t.name, t.io) for t in r.cache.header().tiers] == [("device", None), ("host", None), ("disk", "buffered")]
    r.add("a", 8)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "disk")
    r.cache.ensure_resident(["a"])
    r.assert_intact("a")
    # AND insisting on O_DIRECT there is a typed error naming the directory
    with pytest.raises(StorageError) as exc:
        DiskArena("disk", cfg(tmp_path, disk_io="direct"))
    assert exc.value.errno == errno.EINVAL and str(tmp_path) in exc.value.path


def test_buffered_is_used_when_asked(tmp_path):
    a = DiskArena("disk", cfg(tmp_path, disk_io="buffered"))
    a.grow()
    try:
        assert a.io == "buffered" and not fcntl.fcntl(a._fds[0], fcntl.F_GETFL) & os.O_DIRECT
    finally:
        a.close()


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(["auto", "buffered"]), head_dim=st.sampled_from([8, 64]),
       start=st.integers(0, 5), n=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_write_then_read_round_trips_with_checksums_and_views_agree(tmp_path_factory, mode, head_dim, start, n, seed):
    # GIVEN a disk arena (padded slots for small blocks, unpadded for 16 KiB ones) in either mode
    n = min(n, 6 - start)
    a = DiskArena("disk", cfg(tmp_path_factory.mktemp("d"), head_dim=head_dim, disk_io=mode))
    a.grow()
    try:
        rows = np.random.default_rng(seed).integers(0, 256, (n, a.bytes_per_block), dtype=np.uint8)
        # WHEN a run of slots is written and read back, with checksums
        wrote = a.write(start, rows, checksum=True)
        back = np.zeros_like(rows)
        read = a.read(start, back, checksum=True)
        # THEN the bytes and both checksums agree with the definition
        assert np.array_equal(back, rows)
        assert wrote == read == [reference_sum(r.tobytes()) for r in rows]
        # AND the mapped view sees what direct I/O wrote, and direct I/O sees what the view wrote
        assert np.array_equal(a.view(start, n).contiguous().view(torch.uint8).reshape(n, -1).numpy(), rows)
        a.view(start, 1).view(torch.uint8).fill_(7)
        a.read(start, back[:1])
        assert (back[0] == 7).all()
    finally:
        a.close()


@pytest.mark.parametrize("mode, head_dim, block_size", [("auto", 64, 16), ("buffered", 64, 16), ("auto", 8, 4),
                                                       ("buffered", 8, 4)])  # 32 KiB blocks, and 1 KiB ones padded
def test_a_swap_to_neighbouring_disk_slots_is_a_few_large_transfers(tmp_path, monkeypatch, mode, head_dim, block_size):
    # GIVEN host blocks and a disk arena, counted at the system call
    c = cfg(tmp_path, head_dim=head_dim, block_size=block_size, disk_blocks=64, host_blocks=64, chunk_blocks=64,
            disk_io=mode)
    host, disk = TensorArena("host", c, "cpu"), DiskArena("disk", c)
    host.grow()
    disk.grow()
    host.view(0, 64).view(torch.int16).random_(-30000, 30000)
    calls = []
    for name in ("pwritev", "preadv"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, bufs, pos, _real=real, _name=name: calls.append(_name) or _real(fd, bufs, pos))
    try:
        # WHEN 40 blocks scattered in host memory go to two runs of neighbouring disk slots, and come back
        src = list(range(0, 40, 2)) + list(range(63, 43, -1))
        dst = list(range(10, 30)) + list(range(40, 60))
        sums_out = copy_slots(host, src, disk, dst, checksum=True)
        back = list(range(0, 40))
        host.view(0, 64).zero_()
        sums_in = copy_slots(disk, dst, host, back, checksum=True)
        # THEN each disk run is moved in calls of up to IO_PIECE bytes, not one call per block
        per_run = -(-20 * disk.stride // IO_PIECE)  # (and never more than 512 blocks a call)
        assert calls.count("pwritev") == calls.count("preadv") == 2 * per_run < 40
        # AND the checksums taken leaving and arriving match (the bytes survived the round trip)
        assert sums_out == sums_in and None not in sums_out
        assert sums_in == sum64(host.view(0, 40))
    finally:
        disk.close()


def test_a_failing_disk_read_is_a_storage_error(tmp_path, monkeypatch):
    a = DiskArena("disk", cfg(tmp_path))
    a.grow()

    def broken(fd, bufs, pos):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    try:
        with pytest.raises(StorageError) as exc:
            a.read(0, np.zeros((2, a.bytes_per_block), dtype=np.uint8))
        assert exc.value.errno == errno.EIO and exc.value.path == a.path(0) and "read" in str(exc.value)
    finally:
        a.close()


@pytest.mark.parametrize("kernel", ["engine", "streamed", "numpy"])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), words=st.integers(1, 64), shift=st.integers(0, 9), data=st.data())
def test_the_one_pass_copy_sum_copies_and_sums_like_the_definition(kernel, n, words, shift, data):
    # GIVEN blocks of arbitrary bytes (extreme words included, so the sum wraps)
    extremes = st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1, 2**63])
    vals = data.draw(st.lists(st.one_of(st.integers(0, 2**64 - 1), extremes), min_size=n * words, max_size=n * words))
    src = np.array(vals, dtype=np.uint64).view(np.uint8).reshape(n, words * 8)
    # (into rows ``shift`` words off a cache line and further apart than they are long: the streamed
    # stores start at the first aligned word)
    dst = np.zeros((n, (words + 16) * 8), dtype=np.uint8)[:, shift * 8 : (shift + words) * 8]
    # WHEN copied with their checksums taken in the same pass: by the engine's kernel (the compiled one where
    # a compiler is, with the non-temporal stores a large batch gets, or numpy's, the fallback without one)
    with pytest.MonkeyPatch.context() as mp:
        if kernel == "streamed":
            mp.setattr(checksum, "_STREAM_BYTES", 0)
        if kernel == "numpy":
            mp.setattr(checksum, "_copy_sum_kernel", lambda: checksum._numpy_copy_sum)
        sums = copy_sum(dst, src)
    # THEN the copy is exact and each sum is the definition's, as is the sum without a copy
    assert np.array_equal(dst, src)
    assert sums == sum64_rows(src) == [reference_sum(r.tobytes()) for r in src]
