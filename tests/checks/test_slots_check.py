"""The slots check: reads of positions no write produced, and cuts that leave another length than asked."""

from __future__ import annotations

from tracebuilder import rules

from kvdoctor.events import Padding, Truncate


def test_a_read_past_what_was_written_names_sequence_block_positions_layer_and_step(trace):
    # GIVEN a block allocated for a sequence whose first six slots nobody wrote (a reset that only zeroed)
    trace.start("s")
    trace.alloc(4, "s")
    trace.write(4, "s", 3, pos=6)
    # WHEN the sequence attends to positions 0-8
    trace.read("s", [4], layer=0, span=[0, 9])
    trace.end_step()
    findings = [f for f in trace.run() if f.check == "slots"]
    # THEN one finding names the unwritten positions
    assert rules(findings) == ["slots/unwritten-read"]
    (f,) = findings
    assert (f.seq, f.block, f.layer, f.step) == ("s", 4, 0, 0)
    assert "positions 0-5 of block 4" in f.message and f.evidence["positions"] == list(range(6))


def test_a_block_allocated_and_never_written_is_named_when_read(trace):
    trace.start("s")
    for b in (1, 2, 3):
        trace.alloc(b, "s")
    trace.write(1, "s", 4, pos=0)
    trace.write(3, "s", 4, pos=8)
    trace.read("s", [1, 2, 3], versions=[4, 0, 8], span=[0, 12])
    trace.end_step()
    (f,) = [f for f in trace.run() if f.check == "slots"]
    assert f.block == 2 and "positions 4-7" in f.message


def test_reads_within_what_was_written_and_reads_without_a_span_are_clean(trace):
    # near misses: a window that starts past the first block, a block freed and written again, no span at all
    trace.start("s")
    trace.alloc(1, "s")
    trace.write(1, "s", 4, pos=0)
    trace.alloc(2, "s")
    trace.write(2, "s", 2, pos=4)
    trace.read("s", [1, 2], span=[0, 6])
    trace.read("s", [2], span=[4, 6])
    trace.read("s", [1, 2])
    trace.end_step()
    assert [f for f in trace.run() if f.check == "slots"] == []


def test_a_block_reallocated_forgets_the_writes_of_its_last_life(trace):
    trace.start("a")
    trace.alloc(1, "a")
    trace.write(1, "a", 4, pos=0)
    trace.release(1, "a")
    trace.free(1)
    trace.start("b")
    trace.alloc(1, "b")
    trace.read("b", [1], versions=[0], span=[0, 4])  # fresh block: its bytes are a's leftovers (vllm PR #43990)
    trace.end_step()
    (f,) = [f for f in trace.run() if f.check == "slots"]
    assert (f.seq, f.block) == ("b", 1) and "positions 0-3" in f.message


def test_a_reset_that_leaves_the_old_length_is_a_cut_length_finding(trace):
    trace._emit(Truncate, op="reset", keep=0, length=14, layer=0, cache="c1", asked="reset()")
    trace._emit(Truncate, op="crop", keep=3, length=3, layer=0, cache="c1", asked="crop(-2)")
    trace.end_step()
    (f,) = trace.run()
    assert (f.check, f.rule, f.layer, f.step) == ("slots", "cut-length", 0, 0)
    assert "should leave 0 slots per row, but the cache reports 14" in f.message and "#48509" in f.message


def test_nan_written_into_padding_slots_is_named_where_written_and_clean_padding_is_not(trace):
    # GIVEN a padded batch: row "a" padded in slots 0-3 with finite K/V, row "b" in slots 0-2 with NaN from layer 1
    trace.start("a")
    trace.start("b")
    trace._emit(Padding, seq="a", slots=[0, 1, 2, 3], nonfinite=0, cache="c1")
    trace._emit(Padding, seq="b", slots=[0, 1, 2], nonfinite=6, layer=1, cache="c1")
    trace.end_step()
    # THEN only row "b" is named, with its slots, the layer and the step the NaN was written at
    (f,) = [f for f in trace.run() if f.check == "slots"]
    assert (f.rule, f.seq, f.layer, f.step) == ("padding-nonfinite", "b", 1, 0)
    assert "padding slots 0-2 at layer 1" in f.message and f.evidence["nonfinite"] == 6


def test_nan_written_into_real_slots_names_sequence_block_positions_layer_step_and_writer(trace):
    # GIVEN two sequences; "b" writes K/V that hold a NaN at positions 5-6 from layer 3, its attention going
    # non-finite at that same layer (a query reads its own key), "a" writes finite K/V
    trace.start("a")
    trace.start("b")
    trace.alloc(1, "a")
    trace.alloc(2, "b")
    trace.write(1, "a", 4, pos=0)
    trace.write(2, "b", 3, pos=4, nonfinite=[5, 6], nonfinite_layer=3, stack=["app.py:12 serve"])
    trace.attn("b", 3, nonfinite=2)
    trace.end_step()
    # THEN one finding names the write: sequence, block, positions, first layer, step, and the writer's frames
    (f,) = [f for f in trace.run() if f.check == "slots"]
    assert (f.rule, f.seq, f.block, f.layer, f.step) == ("nonfinite-write", "b", 2, 3, 0)
    assert f.evidence["positions"] == [5, 6] and "position(s) 5-6, first at layer 3" in f.message
    assert f.stacks["write"] == ["app.py:12 serve"] and f.code_location == ("app.py", 12)


def test_nan_that_came_up_from_below_is_left_to_where_it_began(trace):
    # GIVEN a NaN written by "a" at layer 2 (reported), then, a step later, "b" and "c" writing NaN from layer 3:
    # "b" because it read a's block holding NaN at layer 2 (a NaN value, finite scores), "c" because its
    # attention went non-finite at layer 2
    for seq, block in (("a", 1), ("b", 2), ("c", 3)):
        trace.start(seq)
        trace.alloc(block, seq)
    trace.write(1, "a", 1, pos=0, nonfinite=[0], nonfinite_layer=2)
    trace.end_step()
    trace.next_step()
    trace.share(1, "b")
    trace.write(2, "b", 1, pos=4, nonfinite=[4], nonfinite_layer=3)
    trace.read("b", [1, 2])
    trace.write(3, "c", 1, pos=0, nonfinite=[0], nonfinite_layer=3)
    trace.attn("c", 2, nonfinite=1)
    trace.end_step()
    # THEN only the first write is named: the later ones are its consequences
    findings = [f for f in trace.run() if f.check == "slots"]
    assert [(f.rule, f.seq, f.layer, f.step) for f in findings] == [("nonfinite-write", "a", 2, 0)]
