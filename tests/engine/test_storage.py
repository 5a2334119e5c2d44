"""Arenas: layout, growth in chunks, the private, self-cleaning spill directory, and a tier's arenas per codec."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.errors import StorageError
from kvdoctor.engine.kv.codecs import Calibration
from kvdoctor.engine.errors import OutOfBlocks
from kvdoctor.engine.kv.pool import TierSlots
from kvdoctor.engine.kv.storage import DiskArena, TensorArena, TierArenas, runs


def cfg(**kw):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                device_blocks=8, host_blocks=8, disk_blocks=8, chunk_blocks=3)
    base.update(kw)
    return EngineConfig(**base)


def test_tensor_arena_grows_in_chunks_up_to_capacity_and_keeps_contents():
    # GIVEN an arena of capacity 8 growing by 3
    a = TensorArena("device", cfg(), "cpu")
    assert list(a.grow()) == [0, 1, 2]
    a.view(1, 1).fill_(7.0)
    # WHEN it grows again (and again, capped at capacity)
    assert list(a.grow()) == [3, 4, 5]
    assert list(a.grow()) == [6, 7]
    assert list(a.grow()) == []
    # THEN what was written survives each growth
    assert bool((a.view(1, 1) == 7.0).all()) and a.num_slots == 8
    assert a.nbytes == 8 * a.config.bytes_per_block


def test_layout_keeps_one_heads_k_and_v_contiguous():
    c = cfg()
    a = TensorArena("device", c, "cpu")
    a.grow()
    kv = a.layer_kv(1)  # (P, H, 2, bs, D)
    kv[2, 1, 0].fill_(1.0)  # K of head 1
    kv[2, 1, 1].fill_(2.0)  # V of head 1
    row = a.view(2, 1)[0, 1, 1]  # layer 1, head 1: one row
    n = c.block_size * c.head_dim
    assert bool((row[:n] == 1).all()) and bool((row[n : 2 * n] == 2).all())
    assert row.numel() * 4 % 128 == 0 and a.view(0, 1).is_contiguous()


def test_runs_split_at_gaps_and_chunk_edges():
    assert list(runs([0, 1, 2, 5], [3, 4, 5, 6], 100, 100)) == [(0, 3, 3), (5, 6, 1)]
    assert list(runs([2, 3, 4], [0, 1, 2], 3, 100)) == [(2, 0, 1), (3, 1, 2)]  # slot 3 starts a new chunk


def test_disk_arena_private_dir_files_and_cleanup(tmp_path):
    # GIVEN a disk arena under a parent directory
    a = DiskArena("disk", cfg(disk_dir=str(tmp_path)))
    d = a.dir
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    # WHEN it grows twice
    a.grow()
    a.grow()
    files = sorted(os.listdir(d))
    # THEN one 0600 file per chunk, and writes go through the mapping
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600
    a.view(4, 1).fill_(3.0)
    assert bool((a.view(4, 1) == 3.0).all())
    with open(a.path(1), "rb") as fh:  # slot 4 is slot 1 of chunk 1
        fh.seek(a.stride)  # slots start on 4 KiB boundaries (direct I/O)
        assert torch.frombuffer(bytearray(fh.read(16)), dtype=torch.float32).tolist() == [3.0] * 4
    # WHEN it is closed THEN the directory is gone
    a.close()
    assert not os.path.exists(d)


def test_disk_full_is_a_storage_error_and_leaves_nothing(tmp_path, monkeypatch):
    a = DiskArena("disk", cfg(disk_dir=str(tmp_path)))

    def no_space(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(StorageError) as exc:
        a.grow()
    assert exc.value.errno == errno.ENOSPC and exc.value.tier == "disk"
    assert a.num_slots == 0 and os.listdir(a.dir) == []  # the half-made file is removed
    a.close()


def test_unwritable_spill_parent_is_a_storage_error(tmp_path, monkeypatch):
    import tempfile

    def denied(**kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(StorageError) as exc:
        DiskArena("disk", cfg(disk_dir=str(tmp_path)))
    assert exc.value.errno == errno.EACCES and str(tmp_path) in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_real_permission_denied(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(StorageError) as exc:
        DiskArena("disk", cfg(disk_dir=str(ro)))
    assert exc.value.errno == errno.EACCES


def test_spill_dir_goes_even_without_close(tmp_path):
    import gc

    a = DiskArena("disk", cfg(disk_dir=str(tmp_path)))
    a.grow()
    d = a.dir
    del a
    gc.collect()
    assert not os.path.exists(d)


def test_tier_arenas_are_made_per_codec_on_first_use(tmp_path):
    # GIVEN per-tier codecs: the device may hold fp32, int8 and nf4 blocks, the disk only nf4
    c = cfg(codec="device=fp32,host=int8,disk=nf4", calibration=Calibration(torch.ones(2, 2, 8), 1, 1, "ones"),
            disk_dir=str(tmp_path))
    dev, disk = TierArenas("device", c), TierArenas("disk", c)
    try:
        # THEN only the tier's own arena exists until another codec's is asked for
        assert dev.codecs == ("fp32", "int8", "nf4") and [a is not None for a in dev.arenas] == [True, False, False]
        assert disk.codecs == ("nf4",) and disk.primary.codec == "nf4" and disk.primary.dtype == torch.uint8
        nf4 = dev.get(dev.index("nf4"))
        assert nf4.codec == "nf4" and nf4.block_shape[-1] == c.layout("nf4").row_elems and nf4.num_slots == 0
        # AND a slot number names its arena; the primary's slots are the plain numbers
        assert dev.shift == c.device_blocks.bit_length() and dev.slot(0, 5) == 5
        assert dev.at(dev.slot(2, 3)) == (nf4, 3)
    finally:
        dev.close()
        disk.close()
    assert not os.listdir(tmp_path)  # every codec's spill directory is gone


def test_tier_slots_count_blocks_across_arenas():
    # GIVEN a tier of capacity 3 with two arenas, each growing by 2
    grown: list[int] = []

    def grow(arena: int) -> range:
        n = sum(1 for a in grown if a == arena)
        grown.extend([arena] * 2)
        return range(2 * n, min(2 * n + 2, 3))

    ts = TierSlots("device", 3, grow, num_arenas=2)
    # WHEN slots are taken in both arenas
    a, b, c = ts.take(0), ts.take(1), ts.take(1)
    # THEN arena 0 hands out plain numbers, arena 1 numbers above 1 << shift, and the tier is full
    assert a == 0 and (b, c) == (1 << ts.shift, 1 << ts.shift | 1)
    assert ts.used == 3 and ts.num_free == 0 and ts.used_by == [1, 2]
    # AND a slot given back returns to its own arena
    ts.give(c)
    assert ts.used_by == [1, 1] and ts.free == [[1], [1]] and ts.take(1) == c
    assert ts.grown_by == [2, 2]
    with pytest.raises(OutOfBlocks):
        TierSlots("host", 0, grow).take()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_an_arena_grown_in_inference_mode_takes_writes_outside_it(tmp_path, kind):
    # GIVEN an arena first grown inside inference mode (the runner's forward makes room there)
    a = TensorArena("host", cfg(), "cpu") if kind == "memory" else DiskArena("disk", cfg(disk_dir=str(tmp_path)))
    with torch.inference_mode():
        a.grow()
    # WHEN a swap outside it writes a block in place (tiers: a staged copy put back after a failed exchange)
    a.view(0, 1).copy_(torch.ones_like(a.view(0, 1)))
    # THEN the block holds it
    assert bool((a.view(0, 1) == 1).all())
    a.close()
