"""TierMover (engine.kv.mover) on its own: swaps out and in, prefetch, checksums on every move, and the room
it makes or refuses to make. The cache only wires it up; these tests call the mover directly."""

from __future__ import annotations

import pytest
import torch

from kvdoctor.engine.errors import ChecksumMismatch, OutOfBlocks


def _blocks(r, seq):
    return [r.cache.block(i) for i in r.cache.block_table(seq)]


def _corrupt(r, b) -> None:
    """Flip one bit of ``b``'s bytes where it lies now (a bad disk or DMA), behind the engine's back."""
    arena, local = r.cache.tier_arenas[b.tier].at(b.slot)
    arena.view(local, 1).view(torch.uint8).view(-1)[0] ^= 1


def test_swap_out_and_back_in_keeps_the_bytes_and_frees_the_slots(make_cache):
    # GIVEN a sequence of two device blocks
    r = make_cache()
    r.add("a", 6)
    mover, pool = r.cache.mover, r.cache.pool
    blocks = _blocks(r, "a")
    free = pool.slots["device"].num_free
    # WHEN the mover swaps them out to the host
    mover.move(blocks, "host")
    # THEN they live on the host, their device slots are free again, and each move was recorded with its version
    assert [b.tier for b in blocks] == ["host", "host"]
    assert pool.slots["device"].num_free == free + 2
    assert [(e.block, e.src, e.dst, e.version) for e in r.kinds("swap_out")] == [(0, "device", "host", 4),
                                                                                 (1, "device", "host", 6)]
    assert mover.moved[("device", "host")][0] == 2
    # WHEN they come back
    mover.move(blocks, "device")
    # THEN the K/V read back is what was written, and the accounting holds
    assert [b.tier for b in blocks] == ["device", "device"]
    assert [(e.block, e.src, e.dst) for e in r.kinds("swap_in")] == [(0, "host", "device"), (1, "host", "device")]
    r.assert_intact("a")
    pool.check()


def test_a_swap_out_takes_a_checksum_and_a_corrupt_copy_is_never_brought_back(make_cache):
    # GIVEN a block swapped out to the host, where one bit of its copy then flips
    r = make_cache()
    r.add("a", 4)
    (b,) = _blocks(r, "a")
    r.cache.mover.move([b], "host")
    assert b.checksum is not None  # taken as the bytes left
    _corrupt(r, b)
    free = r.cache.pool.slots["device"].num_free
    # WHEN the mover brings it back
    with pytest.raises(ChecksumMismatch) as err:
        r.cache.mover.move([b], "device")
    # THEN the typed error names the block and its tier, the block stays on the host, the device slot it was
    # given is free again, and the mismatch is an event
    assert (err.value.block, err.value.tier) == (b.id, "host")
    assert b.tier == "host" and r.cache.pool.slots["device"].num_free == free
    assert [(e.block, e.tier) for e in r.kinds("checksum_error")] == [(b.id, "host")]
    r.cache.pool.check()


def test_prefetch_copies_in_the_background_and_books_when_settled(make_cache):
    # GIVEN two blocks on the host
    r = make_cache(prefetch_depth=4)
    r.add("a", 6)
    blocks = _blocks(r, "a")
    mover = r.cache.mover
    mover.move(blocks, "host")
    # WHEN the mover prefetches them to the device
    assert mover.prefetch(blocks, "device") == 2
    # THEN the copies are in flight with their device slots reserved, and the prefetch is an event
    assert set(mover.inflight) == {b.id for b in blocks} and all(b.tier == "host" for b in blocks)
    assert [(e.blocks, e.src, e.dst) for e in r.kinds("prefetch")] == [([0, 1], "host", "device")]
    # WHEN every finished copy is booked
    mover.drain()
    mover.poll()
    # THEN the blocks live on the device, marked as prefetched (a later use counts as a hit), bytes intact
    assert not mover.inflight and [b.tier for b in blocks] == ["device", "device"]
    assert mover.prefetched == {b.id for b in blocks}
    r.assert_intact("a")
    r.cache.pool.check()


def test_prefetch_of_a_block_already_there_starts_nothing(make_cache):
    # GIVEN blocks on the device WHEN prefetched to the device THEN nothing starts
    r = make_cache()
    r.add("a", 4)
    assert r.cache.mover.prefetch(_blocks(r, "a"), "device") == 0
    assert not r.cache.mover.inflight and not r.kinds("prefetch")


def test_making_room_demotes_the_policys_victims_one_tier_down(make_cache):
    # GIVEN a full device: four blocks of two sequences, none pinned (their step has ended)
    r = make_cache()
    r.add("a", 8)
    r.add("b", 8)
    r.cache.end_step()
    assert r.cache.free_blocks("device") == 0
    # WHEN two slots are asked for, keeping b's blocks
    keep = set(r.cache.block_table("b"))
    r.cache.mover.make_room("device", 2, keep)
    # THEN a's two blocks went to the host (the next tier down), b's stayed
    assert r.cache.free_blocks("device") == 2
    assert [b.tier for b in _blocks(r, "a")] == ["host", "host"]
    assert [b.tier for b in _blocks(r, "b")] == ["device", "device"]
    r.cache.pool.check()


def test_making_room_that_cannot_be_made_raises_with_the_numbers_and_moves_nothing(make_cache):
    # GIVEN a full device whose every block the current step pins
    r = make_cache()
    r.add("a", 8)
    r.add("b", 8)
    where = {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()}
    # WHEN room for one block is asked for
    with pytest.raises(OutOfBlocks) as err:
        r.cache.mover.make_room("device", 1, set())
    # THEN the typed error says which tier, how many were asked and how many could be had; nothing moved
    assert (err.value.tier, err.value.requested, err.value.free) == ("device", 1, 0)
    assert {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()} == where
    assert not r.kinds("swap_out")


def test_the_last_tier_evicts_and_never_a_sequences_newest_block(make_cache):
    # GIVEN one tier only, full with two sequences of two blocks each, nothing pinned
    r = make_cache(host_blocks=0, disk_blocks=0)
    r.add("a", 8)
    r.add("b", 8)
    r.cache.end_step()
    first, newest = _blocks(r, "a")
    # WHEN room for one block is asked for, keeping b's blocks
    r.cache.mover.make_room("device", 1, set(r.cache.block_table("b")))
    # THEN a's older block is evicted (there is no tier below to demote it to); its newest, where the next
    # token goes, stays
    assert [(e.block, e.tier, e.reason) for e in r.kinds("evict")] == [(first.id, "device", "capacity")]
    assert r.cache.blocks_of("a") == [newest] and r.cache.free_blocks("device") == 1
    # AND with nothing left it may take, asking again fails
    with pytest.raises(OutOfBlocks):
        r.cache.mover.make_room("device", 2, set(r.cache.block_table("b")))
    r.cache.pool.check()
