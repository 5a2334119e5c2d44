"""When the disk lets the engine down: full disk, permission denied, a corrupted spill file.

In each case the error reaches the caller typed and with its numbers, and the pool
is left consistent (every block in exactly one tier, accounting balanced), so the
caller can drop or recompute the affected sequence and carry on.
"""

from __future__ import annotations

import errno
import os

import pytest

from kvdoctor.engine.errors import ChecksumMismatch, StorageError


def fill_to_disk_edge(r):
    """Device and host full (4 + 4 blocks); the next demotion has to grow the disk arena."""
    for i in range(4):
        r.add(i, 8)
        r.cache.end_step()


def test_disk_full_while_spilling_fails_the_step_and_keeps_the_pool(make_cache, monkeypatch):
    r = make_cache()
    fill_to_disk_edge(r)

    def no_space(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()}
    # WHEN a new sequence needs room and spilling hits a full disk
    r.cache.add_sequence("new", 8)
    with pytest.raises(StorageError) as exc:
        r.cache.reserve("new", 8)
    # THEN the error says so, and no block moved or leaked
    assert exc.value.errno == errno.ENOSPC and "disk" in str(exc.value)
    assert {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()} == before
    r.cache.pool.check()
    # AND once space is back the same request succeeds
    monkeypatch.undo()
    r.cache.end_step()
    r.write("new", 8)
    for i in [0, 1, 2, 3, "new"]:
        r.assert_intact(i)
        r.cache.end_step()


def test_permission_denied_on_a_spill_file(make_cache, monkeypatch):
    r = make_cache()
    fill_to_disk_edge(r)
    real_open = os.open

    def deny(path, flags, mode=0o777, **kw):
        if str(path).endswith(".kv"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", deny)
    r.cache.add_sequence("new", 4)
    with pytest.raises(StorageError) as exc:
        r.cache.reserve("new", 4)
    assert exc.value.errno == errno.EACCES and exc.value.path.endswith(".kv")
    r.cache.pool.check()


def test_corrupted_spill_file_surfaces_a_checksum_error(make_cache):
    # GIVEN a sequence whose blocks were swapped out to disk
    r = make_cache()
    r.add("a", 8)
    r.add("b", 4)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "disk")
    blk = r.cache.pool.blocks[r.cache.block_table("a")[1]]
    disk = r.cache.arenas["disk"]
    # WHEN someone scribbles over that block in the spill file
    chunk, local = divmod(blk.slot, disk.chunk)
    with open(disk.path(chunk), "r+b") as fh:
        fh.seek(local * disk.stride + 100)
        fh.write(b"\xde\xad\xbe\xef")
    # THEN bringing the sequence back raises, with the numbers, and emits checksum_error
    with pytest.raises(ChecksumMismatch) as exc:
        r.cache.ensure_resident(["a"])
    assert exc.value.block == blk.id and exc.value.tier == "disk" and exc.value.expected != exc.value.actual
    (ev,) = r.kinds("checksum_error")
    assert (ev.block, ev.tier, ev.expected, ev.actual) == (blk.id, "disk", exc.value.expected, exc.value.actual)
    # AND the corrupt copy was not used: the block is still on disk, the good block came up
    assert blk.tier == "disk"
    assert r.cache.pool.blocks[r.cache.block_table("a")[0]].tier == "device"
    assert [e.block for e in r.kinds("swap_in")] == [r.cache.block_table("a")[0]]
    r.cache.pool.check()
    # AND asking again fails again (never serves the bad copy); dropping the sequence cleans up
    with pytest.raises(ChecksumMismatch):
        r.cache.gather("a", 0)
    r.cache.remove_sequence("a", reason="aborted")
    r.cache.end_step()
    r.assert_intact("b")
    r.cache.pool.check()
    assert r.cache.stats()["tiers"]["disk"]["used_blocks"] == 0


def test_corrupt_copy_found_by_prefetch_is_never_served(make_cache):
    r = make_cache(prefetch_depth=4)
    r.add("a", 4)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "host")
    blk = r.cache.pool.blocks[r.cache.block_table("a")[0]]
    r.cache.arenas["host"].view(blk.slot, 1).view(-1)[0] += 1.0  # a bit flip in host memory
    r.cache.prefetch("a")
    r.cache.mover.drain()  # the copy has landed ...
    r.cache.end_step()  # ... and is checked when booked: it fails, and the block stays behind
    assert blk.tier == "host" and [e.block for e in r.kinds("checksum_error")] == [blk.id]
    with pytest.raises(ChecksumMismatch):
        r.cache.ensure_resident(["a"])
    r.cache.pool.check()
