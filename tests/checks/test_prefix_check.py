"""The prefix check: hits whose content key differs from the block's registration, and hits on a
block written again after it was registered — with the clean hit and the same-step fill silent."""

from __future__ import annotations

from tracebuilder import rules

CACHE = "prefix-cache"


def _registered_block(trace, block=7, key="k1"):
    """GIVEN r1 fills `block` and the prefix cache registers it under `key`, then r1 ends."""
    trace.start("r1")
    trace.alloc(block, "r1")
    trace.write(block, "r1", 4)
    trace.share(block, CACHE, hash=key)
    trace.end_step()
    trace.next_step()
    trace.release(block, "r1")
    trace.end("r1")
    trace.end_step()
    trace.next_step()
    return block


def test_a_hit_under_the_registered_key_is_clean(trace):
    block = _registered_block(trace)
    trace.start("r2")
    trace.share(block, "r2", hash="k1")
    trace.read("r2", [block])
    assert trace.run() == []


def test_a_hit_under_another_key_is_a_hash_mismatch_naming_sequence_and_block(trace):
    block = _registered_block(trace)
    trace.start("r2")
    trace.share(block, "r2", hash="other-prefix")
    findings = trace.run()
    assert rules(findings) == ["prefix/hash-mismatch"]
    f = findings[0]
    assert (f.seq, f.block) == ("r2", block)
    assert f.evidence["registered_key"] == "k1" and f.evidence["registered_by"] == CACHE


def test_a_hit_on_a_block_rewritten_after_registration_is_reported(trace):
    # GIVEN a registered block handed to r3 without leaving the cache, and r3 writes into it
    block = _registered_block(trace)
    trace.start("r3")
    trace.share(block, "r3")
    trace.write(block, "r3", 2, pos=0)
    trace.end_step()
    trace.next_step()
    # WHEN r2 hits it under the original key
    trace.start("r2")
    trace.share(block, "r2", hash="k1")
    findings = [f for f in trace.run() if f.check == "prefix"]
    # THEN the hit is named with the rewrite
    assert rules(findings) == ["prefix/rewritten-hit"]
    assert findings[0].seq == "r2" and findings[0].evidence["rewritten_by"] == "r3"


def test_writes_in_the_registering_step_and_a_new_life_after_eviction_are_clean(trace):
    # GIVEN the cache registers a block in the step that fills it (as vLLM does while scheduling)
    trace.start("r1")
    trace.alloc(5, "r1")
    trace.share(5, CACHE, hash="k1")
    trace.write(5, "r1", 4)
    trace.end_step()
    trace.next_step()
    trace.release(5, "r1")
    trace.end("r1")
    # WHEN the block is evicted and reused for other tokens under another key
    trace.evict(5, reason="prefix-cache")
    trace.start("r2")
    trace.alloc(5, "r2")
    trace.write(5, "r2", 4)
    trace.share(5, CACHE, hash="k2")
    trace.end_step()
    trace.next_step()
    trace.start("r3")
    trace.share(5, "r3", hash="k2")
    # THEN nothing is reported
    assert [f for f in trace.run() if f.check == "prefix"] == []
