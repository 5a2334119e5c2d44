"""The transfer check: blocks freed, reused, written or read while asynchronous work on them is in flight,
loads that failed and are read anyway, transfers that never finish — and the clean sequences beside them."""

from __future__ import annotations

from tracebuilder import rules

from kvdoctor.events import TransferDone, TransferFailed, TransferStart


def _start(trace, blocks, op="save", transfer="t1", seq="r1", lease=None):
    trace._emit(TransferStart, transfer=transfer, op=op, blocks=list(blocks), seq=seq, lease_steps=lease)


def test_blocks_freed_after_their_save_finished_are_clean(trace):
    # GIVEN a finished request whose blocks a connector sends before they are freed
    blocks = trace.sequence_with_blocks("r1", 2)
    _start(trace, blocks)
    trace.end_step()
    trace._emit(TransferDone, transfer="t1")
    trace.end("r1")
    for b in blocks:
        trace.free(b)
    trace.end_step()
    assert trace.run() == []


def test_a_block_freed_while_its_save_still_reads_it_is_named_with_the_transfer(trace):
    # GIVEN a save in flight over two blocks
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    _start(trace, [b0, b1])
    # WHEN the engine frees them before the transfer is done (vLLM #52360)
    trace.end("r1")
    trace.free(b0)
    trace.free(b1)
    trace.end_step()
    findings = trace.run()
    # THEN each block is named with the transfer racing it
    assert rules(findings) == ["transfer/freed-in-flight"] * 2
    assert sorted(f.block for f in findings) == [b0, b1]
    assert "while save 't1'" in findings[0].message and findings[0].evidence["transfer"] == "t1"


def test_a_block_written_while_loaded_and_one_read_before_the_load_finished_are_errors(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    _start(trace, [b0], op="load")
    trace.read("r1", [b0])
    trace.write(b0, "r1", n=1)
    trace.end_step()
    assert rules(trace.run()) == ["transfer/read-in-flight", "transfer/written-in-flight"]


def test_a_failed_load_read_before_any_write_is_an_error_and_a_rewrite_clears_it(trace):
    # GIVEN two blocks whose load failed
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    _start(trace, [b0, b1], op="load")
    trace._emit(TransferFailed, transfer="t1", reason="handshake failed")
    # WHEN one is recomputed (written) and both are read
    trace.write(b1, "r1", n=1)
    trace.read("r1", [b0, b1])
    trace.end_step()
    findings = trace.run()
    # THEN only the block nothing rewrote is named
    assert rules(findings) == ["transfer/failed-load-read"]
    assert [f.block for f in findings] == [b0] and "handshake failed" in findings[0].message


def test_a_transfer_open_past_its_lease_never_completed(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    _start(trace, [b0], lease=3)
    for _ in range(5):
        trace.end_step()
    findings = trace.run()
    assert rules(findings) == ["transfer/never-completed"] and findings[0].seq == "r1"


def test_a_transfer_still_open_when_the_trace_ends_within_its_lease_is_not_judged(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    _start(trace, [b0])
    trace.end_step()
    assert trace.run() == []


def test_a_move_that_failed_leaves_its_blocks_readable_and_one_freed_in_flight_is_named(trace):
    # GIVEN a prefetch (a move) over two blocks that failed, and a second one in flight
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    _start(trace, [b0], op="move")
    trace._emit(TransferFailed, transfer="t1", reason="checksum mismatch, copy discarded")
    _start(trace, [b1], op="move", transfer="t2")
    # WHEN the first is read (its copy stayed where it was) and the second is freed before its copy landed
    trace.read("r1", [b0])
    trace.end("r1")
    trace.free(b0)
    trace.free(b1)
    trace.end_step()
    # THEN only the free in flight is a finding, naming the block, its sequence and what the move does
    (f,) = trace.run()
    assert (f.rule, f.block, f.seq) == ("freed-in-flight", b1, "r1")
    assert "while move 't2'" in f.message and "copies it between tiers" in f.message


def test_a_block_swapped_while_its_move_is_in_flight_is_named_and_one_swapped_after_it_is_not(trace):
    # GIVEN two blocks on host, each with a prefetch (a move) to the device
    b0, b1 = trace.sequence_with_blocks("r1", 2, tier="host")
    _start(trace, [b0], op="move", transfer="t1")
    _start(trace, [b1], op="move", transfer="t2")
    trace._emit(TransferDone, transfer="t2")
    # WHEN both are swapped in by a synchronous copy, the first before its prefetch ended
    trace.swap_in(b0, src="host")
    trace.swap_in(b1, src="host")
    trace.end_step()
    # THEN the first is named: the prefetch's copy will land in a slot the block no longer uses
    (f,) = [f for f in trace.run() if f.check == "transfer"]
    assert (f.rule, f.block, f.seq) == ("moved-in-flight", b0, "r1") and "swapped host->device" in f.message
