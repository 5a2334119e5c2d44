"""The integrity check: a block's bytes, as a read or a move saw them, are the bytes its last write made."""

from __future__ import annotations

from tracebuilder import rules


def _filled(trace, block=10, seq="r1", digest=0xABC):
    if seq not in trace.seq_len:
        trace.start(seq, prompt_len=4)
    trace.alloc(block, seq)
    trace.write(block, seq, 4, digest=digest)


def test_reads_and_moves_that_see_the_written_digest_are_silent(trace):
    # GIVEN a written block, read back, swapped out and in with the same digest, and a read not verified
    _filled(trace)
    trace.read("r1", [10], digests=[0xABC])
    trace.swap_out(10, "host", digest=0xABC)
    trace.swap_in(10, "device", digest=0xABC)
    trace.read("r1", [10], digests=[None])
    trace.read("r1", [10])
    # THEN nothing is wrong
    assert trace.run() == []


def test_a_read_of_changed_bytes_names_block_sequence_layer_step_and_the_write(trace):
    # GIVEN two blocks; the second's bytes change without a write (another request's K/V over them)
    _filled(trace, 10)
    trace.write(10, "r1", 0, digest=0xABC)  # (a zero-token write keeps the digest: nothing to see)
    trace.end_step()
    trace.alloc(11, "r1")
    trace.write(11, "r1", 2, digest=0x111)
    trace.end_step()
    # WHEN a read sees another digest, the producer naming layer 3 as the first that differs
    trace.read("r1", [10, 11], digests=[0xABC, 0x999], digest_layers=[None, 3])
    findings = trace.run()
    # THEN one error names the block, its sequence, the layer, the step, and the write that made the content
    assert rules(findings) == ["integrity/read-mismatch"]
    f = findings[0]
    assert (f.severity, f.block, f.seq, f.layer, f.step) == ("error", 11, "r1", 3, 2)
    assert f.evidence["seen_digest"] == 0x999 and f.evidence["expected_digest"] == 0x111
    assert f.evidence["last_write"]["kind"] == "write" and f.evidence["last_write"]["pos"] == 4
    assert "positions 4-5" in f.message and "layer 3" in f.message


def test_a_block_is_reported_once_per_life(trace):
    # GIVEN a corrupt block read twice, then freed and its id allocated and corrupted again
    _filled(trace)
    trace.read("r1", [10], digests=[0x1])
    trace.write(10, "r1", 0, digest=0xABC)
    trace.read("r1", [10], digests=[0x2])
    trace.release(10, "r1")
    trace.free(10)
    trace.start("r2", prompt_len=1)
    trace.alloc(10, "r2")
    trace.write(10, "r2", 1, digest=0x5)
    trace.read("r2", [10], digests=[0x6])
    # THEN one finding for each life of the id
    assert rules(trace.run()) == ["integrity/read-mismatch"] * 2


def test_a_write_without_a_digest_leaves_the_content_unknown(trace):
    # GIVEN a producer that stopped recording digests for one write
    _filled(trace)
    trace.write(10, "r1", 0)
    # WHEN a later read gives some digest
    trace.read("r1", [10], digests=[0x123])
    # THEN nothing can be said
    assert trace.run() == []


def test_a_re_encode_sets_the_content_later_reads_must_show(trace):
    # GIVEN a block re-encoded to int8 on its way to the host, and back
    _filled(trace)
    trace.swap_out(10, "host", codec="int8", digest=0xABC, new_digest=0x77)
    trace.swap_in(10, "device", codec="int8", digest=0x77)
    trace.read("r1", [10], digests=[0x77])
    trace.recode(10, "int8", "nf4", digest=0x77, new_digest=0x88)
    trace.read("r1", [10], digests=[0x88])
    assert trace.run() == []


def test_moves_and_re_encodes_of_changed_bytes_are_errors_naming_the_owner(trace):
    # GIVEN two blocks: one whose bytes changed on the host, one changed before its re-encode
    _filled(trace, 10, "r1", 0xA)
    _filled(trace, 11, "r2", 0xB)
    trace.swap_out(10, "host", digest=0xA)
    trace.swap_in(10, "device", digest=0xF0, digest_layer=1)
    trace.recode(11, "fp16", "nf4", digest=0xF1, new_digest=0xC)
    trace.read("r2", [11], digests=[0xC])  # the re-encoded bytes are what reads see from then on
    findings = trace.run()
    assert rules(findings) == ["integrity/recode-mismatch", "integrity/swap-mismatch"]
    by_rule = {f.rule: f for f in findings}
    assert (by_rule["swap-mismatch"].block, by_rule["swap-mismatch"].seq, by_rule["swap-mismatch"].layer) == (10, "r1", 1)
    assert (by_rule["recode-mismatch"].block, by_rule["recode-mismatch"].seq) == (11, "r2")


def _merge(trace, block, **digests):
    from kvdoctor.events import Merge

    return trace._emit(Merge, block=block, tier="device", version=trace.block_version.get(block, 0), tokens=4,
                       heads=2, layers=[0], slots=[3], **digests)


def test_a_token_merge_sets_the_content_later_reads_must_show_and_a_merge_of_changed_bytes_is_an_error(trace):
    # GIVEN a block merged from the bytes its write made, read at the merged digest
    _filled(trace, 10, "r1", 0xA)
    _merge(trace, 10, digest=0xA, new_digest=0x5)
    trace.read("r1", [10], digests=[0x5])
    assert trace.run() == []
    # AND a block whose bytes changed before the merge read them
    _filled(trace, 11, "r2", 0xB)
    _merge(trace, 11, digest=0xF, digest_layer=1, new_digest=0x6)
    trace.read("r2", [11], digests=[0x6])  # the merged bytes are what reads see from then on
    findings = trace.run()
    # THEN one error names the merge, the block, its owner and the layer
    assert rules(findings) == ["integrity/merge-mismatch"]
    assert (findings[0].block, findings[0].seq, findings[0].layer) == (11, "r2", 1)
    assert "token merge" in findings[0].message
