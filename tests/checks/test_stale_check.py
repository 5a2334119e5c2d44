"""The stale check: reads and swaps of copies older than the last write, reads after free,
versions that do not advance — and rollbacks and forks that must stay silent."""

from __future__ import annotations

from tracebuilder import rules


def test_read_of_an_older_version_than_the_last_write_is_stale(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.alloc(11, "r1")
    trace.write(11, "r1", 2)  # version 6
    trace.read("r1", [b0, 11], versions=[4, 5])
    findings = trace.run()
    assert rules(findings) == ["stale/stale-read"]
    f = findings[0]
    assert (f.block, f.seq) == (11, "r1")
    assert f.evidence["seen_version"] == 5 and f.evidence["last_write_version"] == 6


def test_near_miss_reads_at_the_written_versions_are_clean(trace):
    blocks = trace.sequence_with_blocks("r1", 3)
    trace.read("r1", blocks, layer=0)
    trace.read("r1", blocks, layer=1)
    assert trace.run() == []


def test_swap_in_serving_an_old_host_copy_is_stale_and_so_is_the_read_after(trace):
    # GIVEN a block swapped out at version 4, brought back and written again (version 5)
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.swap_out(b0, "host")
    trace.swap_in(b0)
    trace.rollback("r1", 1)
    trace.write(b0, "r1", 1)
    trace.swap_out(b0, "host")
    # WHEN the swap-in serves the old version-4 copy
    trace.swap_in(b0, version=4)
    trace.read("r1", [b0], versions=[4])
    findings = trace.run()
    # THEN the swap-in is the stale finding, and the read of what it brought back is in its cascade
    assert rules(findings) == ["stale/stale-swap-in"]
    (f,) = findings
    assert (f.block, f.seq) == (b0, "r1")
    assert f.evidence["cascade"]["rules"] == {"stale/stale-read": 1}


def test_swap_out_moving_an_older_copy_is_stale(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.swap_out(b0, "host", version=2)
    assert rules(trace.run()) == ["stale/stale-swap-out"]


def test_read_of_a_freed_or_evicted_block(trace):
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.release(b1, "r1")
    trace.evict(b1)
    trace.read("r1", [b0, b1], versions=[4, 8])
    findings = trace.run()
    assert rules(findings) == ["stale/read-freed"]
    assert findings[0].block == b1
    assert "evicted" in findings[0].message
    assert findings[0].evidence["history"][-1]["kind"] == "evict"


def test_near_miss_read_of_a_reused_id_after_realloc_is_clean(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.end("r1")
    trace.free(b0)
    trace.start("r2")
    trace.alloc(b0, "r2")
    trace.write(b0, "r2", 2)
    trace.read("r2", [b0])
    assert trace.run() == []


def test_write_that_does_not_advance_the_version_by_n(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.alloc(11, "r1")
    trace.write(11, "r1", 2, version=4)  # stale-version fault: the version did not move
    findings = trace.run()
    assert rules(findings) == ["stale/version-not-advanced"]
    assert findings[0].evidence["expected_version"] == 6


def test_rollback_must_advance_the_version(trace):
    trace.sequence_with_blocks("r1", 1)
    trace.rollback("r1", 2, version=4)
    assert rules(trace.run()) == ["stale/rollback-version"]


def test_rollback_past_what_was_written_or_of_no_tokens_is_a_rollback_count_finding(trace):
    # GIVEN two sequences of one full block each (block size 4 tokens in the builder)
    trace.sequence_with_blocks("r1", 1)
    trace.sequence_with_blocks("r2", 1)
    size = trace.block_size
    # WHEN one is cropped by more than it holds and the other to a longer length (a negative count)
    trace.rollback("r1", size + 3)
    trace.rollback("r2", -5)
    findings = trace.run()
    # THEN each is named with what it held
    assert rules(findings) == ["stale/rollback-count", "stale/rollback-count"]
    assert {f.seq: f.evidence["length"] for f in findings} == {"r1": size, "r2": size}


def test_near_miss_speculative_rollbacks_and_forks_are_clean(trace):
    # GIVEN a sequence that drafts 3 tokens, rejects 2 (rollback), and a fork sharing it
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.alloc(11, "r1")
    trace.write(11, "r1", 3)
    trace.rollback("r1", 2)
    trace.write(11, "r1", 1)
    trace.read("r1", [b0, 11])
    trace.start("r2")
    trace.share(b0, "r2")
    trace.alloc(12, "r2")  # copy-on-write of the partial block
    trace.write(12, "r2", 2, pos=4)
    trace.read("r2", [b0, 12])
    trace.end_step()
    assert trace.run() == []
