"""The batch check: K/V written into or read from another sequence's blocks, rows that do not
start where their sequence ends, malformed batches — and legitimate batching left silent."""

from __future__ import annotations

from tracebuilder import rules


def test_write_into_another_sequences_block(trace):
    (a0,) = trace.sequence_with_blocks("A", 1)
    (b0,) = trace.sequence_with_blocks("B", 1)
    trace.alloc(30, "B")
    trace.write(a0, "B", 1, pos=4)  # B's row landed in A's block
    findings = trace.run()
    assert rules(findings) == ["batch/write-not-owned"]
    f = findings[0]
    assert (f.seq, f.block) == ("B", a0) and f.evidence["owners"] == ["A"]


def test_read_of_another_sequences_block(trace):
    (a0,) = trace.sequence_with_blocks("A", 1)
    (b0,) = trace.sequence_with_blocks("B", 1)
    trace.read("B", [a0, b0], layer=3)
    findings = trace.run()
    assert rules(findings) == ["batch/read-not-owned"]
    assert (findings[0].seq, findings[0].block, findings[0].layer) == ("B", a0, 3)


def test_near_miss_reads_of_shared_prefix_blocks_are_clean(trace):
    (a0,) = trace.sequence_with_blocks("A", 1)
    trace.start("B")
    trace.share(a0, "B")
    trace.alloc(30, "B")
    trace.write(30, "B", 1, pos=4)
    trace.read("B", [a0, 30])
    assert trace.run() == []


def test_write_at_the_wrong_position(trace):
    (a0,) = trace.sequence_with_blocks("A", 1)
    trace.alloc(11, "A")
    trace.write(11, "A", 1, pos=6)  # A holds 4 tokens: the write should start at 4
    assert rules(trace.run()) == ["batch/write-position"]


def test_batch_rows_and_positions_shuffled(trace):
    trace.sequence_with_blocks("A", 1)  # 4 tokens
    trace.start("B")
    trace.alloc(30, "B")
    trace.write(30, "B", 2)  # 2 tokens
    trace.batch(["A", "B"], positions=[2, 4])
    findings = trace.run()
    # THEN one finding for the shuffled batch, at its first row; the second row is counted in its cascade
    assert rules(findings) == ["batch/batch-position"]
    (f,) = findings
    assert (f.seq, f.evidence["expected"]) == ("A", 4)
    assert f.evidence["cascade"]["rules"] == {"batch/batch-position": 1}
    assert f.evidence["cascade"]["sequences"] == ["B"]


def test_near_miss_positions_after_rollback_prefix_share_and_recompute(trace):
    trace.sequence_with_blocks("A", 1)
    trace.alloc(11, "A")
    trace.batch(["A"], n=[3])
    trace.write(11, "A", 3)
    trace.rollback("A", 2)  # A holds 5 tokens
    trace.start("B")
    trace.share(10, "B")  # B starts after A's first block: its length is known from its first write
    trace.batch(["A", "B"], n=[1, 2], positions=[5, 4])
    trace.write(11, "A", 1)
    trace.alloc(31, "B")
    trace.write(31, "B", 2, pos=4)
    trace.end_step()
    # recompute preemption: B drops every block, later restarts from position 0
    trace.release(10, "B")
    trace.release(31, "B")
    trace.free(31)
    trace.end_step()
    trace.batch(["B"], n=[6], positions=[0])
    trace.alloc(32, "B")
    trace.write(32, "B", 4, pos=0)
    trace.end_step()
    assert trace.run() == []


def test_malformed_batches(trace):
    trace.sequence_with_blocks("A", 1)
    trace.sequence_with_blocks("B", 1)
    trace.batch(["A", "B"], n=[1], positions=[4, 4])
    trace.end_step()
    trace.batch(["A", "A"], n=[1, 1], positions=[4, 4])
    trace.end_step()
    trace.batch(["A", "B"], n=[1, 1], shape=[3, 2, 1, 8])
    trace.end_step()
    assert rules(trace.run()) == ["batch/batch-duplicate-row", "batch/batch-lengths", "batch/batch-shape"]


def test_near_miss_padded_and_packed_shapes_fit(trace):
    trace.sequence_with_blocks("A", 1)
    trace.sequence_with_blocks("B", 1)
    trace.batch(["A", "B"], n=[1, 3], shape=[2, 2, 3, 8])  # padded (B, H, T, D)
    trace.batch(["A", "B"], n=[1, 3], shape=[4, 2, 8])  # packed (N, H, D)
    assert trace.run() == []


def test_batch_computing_an_ended_sequence(trace):
    (a0,) = trace.sequence_with_blocks("A", 1)
    trace.end("A")
    trace.free(a0)
    trace.batch(["A"], positions=[4])
    findings = trace.run()
    assert rules(findings) == ["batch/batch-ended-row"]
    assert findings[0].seq == "A"
