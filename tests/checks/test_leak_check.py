"""The leak check: unreachable blocks (above all swapped-out ones), usage disagreement,
blocks of ended sequences left at the end — and the legitimate holders it must not flag."""

from __future__ import annotations

from tracebuilder import rules


def test_swapped_out_block_forgotten_at_seq_end_is_an_unreachable_swapped_leak(trace):
    # GIVEN a sequence with two blocks, one swapped out to host
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.swap_out(b1, "host")
    # WHEN it ends and the engine frees only the device block
    trace.end("r1")
    trace.free(b0)
    trace.end_step()
    findings = trace.run()
    # THEN exactly the swapped block is reported, with its owner and its history
    assert rules(findings) == ["leak/unreachable-swapped"]
    (f,) = findings
    assert (f.block, f.seq, f.step, f.severity) == (b1, "r1", 0, "error")
    assert [e["kind"] for e in f.evidence["history"]] == ["alloc", "write", "swap_out", "seq_end"]
    assert f.evidence["tier"] == "host"


def test_near_miss_every_block_freed_in_the_same_step_is_clean(trace):
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.swap_out(b1, "disk")
    trace.end("r1")
    trace.free(b0)
    trace.free(b1)
    trace.end_step()
    assert trace.run() == []


def test_released_device_block_not_freed_by_step_end_is_unreachable(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.release(b0, "r1")
    trace.end_step()
    trace.free(b0)  # too late: the contract says within the same step
    assert rules(trace.run()) == ["leak/unreachable"]


def test_a_larger_step_closes_the_previous_one_without_a_step_end(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.end("r1")
    trace.next_step()
    trace.start("r2")
    findings = trace.run()
    assert rules(findings) == ["leak/unreachable"]
    assert findings[0].evidence["event_index"] == len(trace.events) - 1  # judged at r2's start


def test_grace_steps_lets_a_lazy_engine_free_in_a_later_step(trace):
    from kvdoctor.checks import LeakSettings

    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.end("r1")
    trace.end_step()
    trace.free(b0)
    trace.end_step()
    assert trace.run(leak=LeakSettings(grace_steps=1)) == []
    assert rules(trace.run()) == ["leak/unreachable"]


def test_prefix_sharing_and_forks_are_not_leaks(trace):
    # GIVEN r2 sharing r1's prefix and a fork r3 of r2
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.start("r2")
    trace.share(b0, "r2")
    trace.share(b1, "r2")
    trace.start("r3")
    trace.share(b0, "r3")
    # WHEN r1 ends first (its blocks still owned), then the others
    trace.end("r1")
    trace.end_step()
    trace.end("r2")
    trace.free(b1)
    trace.end_step()
    trace.end("r3")
    trace.free(b0)
    trace.end_step()
    # THEN nothing is flagged
    assert trace.run() == []


def test_a_prefix_cache_holding_blocks_on_purpose_is_not_a_leak(trace):
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.share(b0, "prefix-cache")  # an owner that is not a request: held until evicted
    trace.end("r1")
    trace.end_step()
    trace.end_step()
    assert trace.run() == []


def test_preemption_by_swap_and_eviction_are_not_leaks(trace):
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.swap_out(b0, "host")
    trace.swap_out(b1, "host")
    trace.end_step()
    trace.swap_out(b1, "disk", src="host")
    trace.swap_in(b1, "device", src="disk")
    trace.swap_in(b0)
    trace.release(b1, "r1")
    trace.evict(b1)
    trace.end("r1")
    trace.free(b0)
    trace.end_step()
    assert trace.run() == []


def test_usage_disagreeing_with_events_is_reported_once_per_difference(trace):
    trace.sequence_with_blocks("r1", 2)
    trace.usage("device", 2)  # agrees
    trace.end_step()
    trace.usage("device", 3)  # disagrees (+1)
    trace.end_step()
    trace.usage("device", 3)  # same disagreement: not again
    trace.end_step()
    findings = trace.run()
    assert rules(findings) == ["leak/usage-mismatch"]
    assert findings[0].evidence["reported"] == 3 and findings[0].evidence["counted"] == 2


def test_usage_counts_follow_swaps_between_tiers(trace):
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.swap_out(b0, "host")
    trace.usage("device", 1)
    trace.usage("host", 1)
    trace.usage("disk", 0)
    trace.end_step()
    assert trace.run() == []


def test_trace_ending_mid_step_with_blocks_of_ended_sequences_reports_left_at_end(trace):
    b0, b1 = trace.sequence_with_blocks("r1", 2)
    trace.end("r1")
    trace.free(b0)  # ...and the trace stops before the step ends
    findings = trace.run()
    assert rules(findings) == ["leak/left-at-end"]
    assert findings[0].block == b1


def test_near_miss_live_sequences_holding_blocks_at_trace_end_are_fine(trace):
    trace.sequence_with_blocks("r1", 2)
    trace.end_step()
    assert trace.run() == []


def test_a_leak_names_where_its_block_was_allocated_and_where_its_sequence_was_aborted(trace):
    # GIVEN a producer that records the user's stack on seq_start, the first alloc and seq_end
    trace.start("r1", stack=["serve.py:10 admit"])
    trace.alloc(1, "r1", stack=["serve.py:22 step_loop", "serve.py:40 main"])
    trace.write(1, "r1", 4)
    trace.alloc(2, "r1")  # later blocks of the sequence: no walk, the sequence's stack stands for them
    trace.write(2, "r1", 4)
    trace.swap_out(2, "host")
    # WHEN the request is aborted and its swapped block forgotten
    trace.end("r1", reason="aborted", stack=["serve.py:31 cancel"])
    trace.free(1)
    trace.end_step()
    (f,) = trace.run()
    # THEN the finding carries the sequence's allocation stack, then the abort's
    assert f.block == 2
    assert f.stacks == {"alloc": ["serve.py:22 step_loop", "serve.py:40 main"], "seq_end": ["serve.py:31 cancel"]}
    assert f.code_location == ("serve.py", 22)


def test_a_finding_about_a_sequence_alone_carries_its_start(trace):
    trace.start("r1", stack=["app.py:5 main"])
    trace.attn("r1", 3, max_logit=float("nan"), nonfinite=2)
    (f,) = trace.run()
    assert f.stacks == {"seq_start": ["app.py:5 main"]}
