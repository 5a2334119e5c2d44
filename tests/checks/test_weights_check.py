"""The weights check: a prefix-cache hit on K/V computed by weights that changed since, with no reset."""

from __future__ import annotations

from tracebuilder import rules

from kvdoctor.events import PREFIX_CACHE, Weights


def _cached_block(trace, seq="r1"):
    """A sequence's full block, registered in the prefix cache, the sequence ended."""
    (b0,) = trace.sequence_with_blocks(seq, 1)
    trace.share(b0, PREFIX_CACHE, hash="k0")
    trace.release(b0, seq)
    trace.end(seq)
    trace.end_step()
    return b0


def _update(trace, version=1):
    trace._emit(Weights, version=version, cause="update", detail="collective_rpc('apply_model(update)')")
    trace.end_step()


def test_a_hit_on_a_block_computed_before_a_weight_update_is_stale_naming_request_block_and_versions(trace):
    # GIVEN a cached block, then the weights updated in place
    b0 = _cached_block(trace)
    _update(trace)
    (b1,) = trace.sequence_with_blocks("r0", 1, first_block=b0 + 1)
    trace.end_step()
    trace._emit(Weights, version=2, cause="update")
    trace.end_step()
    # WHEN a new request hits both
    trace.start("r2")
    trace.share(b0, "r2", hash="k0")
    trace.share(b1, "r2", hash="k0")
    trace.read("r2", [b0, b1])  # what it hit it reads: the stale hit is the cause, not a second finding
    trace.end_step()
    findings = trace.run()
    # THEN one finding: the first stale hit, naming the request, the block, the versions and when the weights
    # changed, with every stale block it hit as evidence
    assert rules(findings) == ["weights/stale-prefix-hit"]
    (f,) = findings
    assert (f.seq, f.block, f.step) == ("r2", b0, 4)
    assert "computed under weights v0; weights are v2 since step 3 (update)" in f.message
    assert f.evidence["stale_blocks"] == [b0, b1]


def test_a_reset_between_the_update_and_the_next_request_leaves_nothing_stale(trace):
    # near miss: the cache evicts the block (a reset) after the update; the new request computes its own
    b0 = _cached_block(trace)
    _update(trace)
    trace.evict(b0, reason="prefix-cache-reset")
    trace.end_step()
    trace.sequence_with_blocks("r2", 1, first_block=b0)
    trace.end_step()
    assert trace.run() == []


def test_a_hit_on_a_block_written_after_the_update_is_fresh(trace):
    # GIVEN the update first, then a block computed and cached under the new weights
    _update(trace)
    b0 = _cached_block(trace)
    trace.start("r2")
    trace.share(b0, "r2", hash="k0")
    trace.end_step()
    assert trace.run() == []


def test_a_sequence_reading_its_own_blocks_across_a_weight_change_is_a_stale_read_warning(trace):
    # GIVEN a sequence with a block written, then the weights changed under it
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.end_step()
    _update(trace)
    # WHEN it reads the block again (twice)
    trace.read("r1", [b0])
    trace.read("r1", [b0])
    trace.end_step()
    findings = trace.run()
    # THEN one warning names the sequence, the block and the change
    assert rules(findings) == ["weights/stale-read"]
    (f,) = findings
    assert (f.severity, f.seq, f.block) == ("warning", "r1", b0) and f.evidence["stale_blocks"] == [b0]


def test_reads_without_any_weight_change_are_not_judged(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.read("r1", [b0])
    trace.end_step()
    assert trace.run() == []
