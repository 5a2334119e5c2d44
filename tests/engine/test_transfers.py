"""The tier mover's prefetches as transfers (``engine/kv/transfers.py``): each opens a ``move`` and closes it when
its copy has landed; one whose copy fails closes as failed and loses nothing; the free-during-prefetch fault
frees a block under its copy, and the transfer check names the sequence, the block and the step."""

from __future__ import annotations

from kvdoctor.checks import make_suite


def _swapped(make_cache, **kw):
    """A cache with sequence "a" of two blocks swapped out to host, listened to by every check."""
    r = make_cache(prefetch_depth=4, **kw)
    suite = make_suite()
    r.cache.bus.subscribe(suite.observe_many)
    r.add("a", 8)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "host")
    return r, suite


def _findings(r, suite) -> list:
    r.cache.bus.flush()
    return suite.findings + suite.finish()


def test_a_prefetch_is_a_move_that_closes_when_its_blocks_land(make_cache):
    r, suite = _swapped(make_cache)
    # WHEN the scheduler prefetches a and then runs it
    assert r.cache.prefetch("a") == 2
    r.assert_intact("a")
    r.cache.end_step()
    # THEN one move of both blocks from host opened, closed done once they landed, and nothing is found
    (start,), (done,) = r.kinds("transfer_start"), r.kinds("transfer_done")
    assert (start.op, start.blocks, start.seq, start.src, start.dst) == ("move", r.cache.block_table("a"), "a",
                                                                          "host", "device")
    assert done.transfer == start.transfer and not r.kinds("transfer_failed")
    assert _findings(r, suite) == []


def test_a_prefetch_whose_copy_fails_closes_failed_and_its_blocks_stay_where_they_were(make_cache, monkeypatch):
    from kvdoctor.engine.kv import mover

    r, suite = _swapped(make_cache)
    blocks = [r.cache.block(b) for b in r.cache.block_table("a")]

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mover, "copy_pairs", broken)  # the copy job cannot read the host arena
    r.cache.prefetch("a")
    r.cache.mover.drain()
    r.cache.end_step()  # booked: the copy failed, its slots go back, the blocks stay on host
    monkeypatch.undo()
    (failed,) = r.kinds("transfer_failed")
    assert "Input/output error" in failed.reason and {b.tier for b in blocks} == {"host"}
    r.assert_intact("a")  # read where they were: brought up by a swap-in
    # THEN the transfer check finds nothing: a failed move loses no block
    assert [f for f in _findings(r, suite) if f.check == "transfer"] == []


def test_free_during_prefetch_frees_a_block_under_its_copy_named_by_the_transfer_check(make_cache):
    r, suite = _swapped(make_cache, fault="free-during-prefetch")
    blocks = r.cache.block_table("a")
    r.cache.prefetch("a")
    step = r.cache.bus.step
    # WHEN the request is aborted while its copies are still in flight (the fault does not wait for them)
    r.cache.remove_sequence("a", reason="aborted")
    r.cache.end_step()
    # THEN each freed block is named with its sequence, the step and the move racing it; the transfer never ends
    found = _findings(r, suite)
    assert sorted((f.rule, f.block, f.seq, f.step) for f in found) == [
        ("freed-in-flight", b, "a", step) for b in sorted(blocks)]
    assert "move 'prefetch-1'" in found[0].message and not r.kinds("transfer_done")
    assert r.cache.faults.hit["block"] in blocks
