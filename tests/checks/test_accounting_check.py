"""The accounting check: events that contradict the cache the earlier events built."""

from __future__ import annotations

from kvdoctor.events import ChecksumError
from tracebuilder import rules


def test_id_reused_while_still_allocated(trace):
    (b0,) = trace.sequence_with_blocks("A", 1)
    trace.start("B")
    trace.alloc(b0, "B")
    assert "accounting/double-alloc" in rules(trace.run())


def test_double_free_and_unknown_block(trace):
    (b0,) = trace.sequence_with_blocks("A", 1)
    trace.end("A")
    trace.free(b0)
    trace.free(b0)
    trace.share(99, "A")
    assert rules(trace.run()) == ["accounting/double-free", "accounting/unknown-block"]


def test_swap_from_a_tier_the_block_is_not_in_or_the_wrong_way(trace):
    b0, b1 = trace.sequence_with_blocks("A", 2)
    trace.swap_out(b0, "disk", src="host")  # it sits on device
    trace.swap_out(b1, "device", src="device")  # not a slower tier
    assert rules(trace.run()) == ["accounting/tier-mismatch", "accounting/tier-mismatch"]


def test_release_by_a_live_non_owner_but_not_after_seq_end(trace):
    (a0,) = trace.sequence_with_blocks("A", 1)
    (b0,) = trace.sequence_with_blocks("B", 1)
    trace.release(a0, "B")
    trace.end("B")
    trace.release(b0, "B")  # seq_end released it already: a late explicit release is fine
    trace.free(b0)
    findings = trace.run()
    assert rules(findings) == ["accounting/release-not-owner"]
    assert (findings[0].seq, findings[0].block) == ("B", a0)


def test_over_capacity(trace):
    trace.sequence_with_blocks("A", 3)
    trace.usage("device", 3, capacity=2)
    assert "accounting/over-capacity" in rules(trace.run())


def test_checksum_mismatch_is_reported_with_the_owner(trace):
    (b0,) = trace.sequence_with_blocks("A", 1)
    trace.events.append(ChecksumError(step=0, block=b0, tier="host", expected=1, actual=2))
    findings = trace.run()
    assert rules(findings) == ["accounting/checksum-mismatch"]
    assert (findings[0].seq, findings[0].block) == ("A", b0)
