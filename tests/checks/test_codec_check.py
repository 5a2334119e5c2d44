"""The codec check: a block's precision only goes down, and a recode re-encodes the latest copy where it is."""

from __future__ import annotations

from tracebuilder import rules


def _written(trace, block=10, codec="fp16", seq="r1"):
    """A block of ``seq`` allocated under ``codec`` and filled (the sequence is started first if new)."""
    if seq not in trace.seq_len:
        trace.start(seq, prompt_len=4)
    trace.alloc(block, seq, codec=codec)
    trace.write(block, seq, 4)


def test_a_block_going_down_the_tiers_and_back_keeps_its_lossiest_codec_silently(trace):
    # GIVEN device fp16, host int8, disk nf4: the block comes back up as nf4 (its bytes went through nf4)
    _written(trace)
    trace.swap_out(10, "host", codec="int8")
    trace.swap_out(10, "disk", codec="nf4")
    trace.swap_in(10, "device", codec="nf4")
    trace.recode(10, "nf4", "nf4")
    # THEN nothing is wrong
    assert trace.run() == []


def test_a_swap_in_that_shows_more_precision_than_the_block_kept_is_an_error(trace):
    # GIVEN a block re-encoded to int8 on its way to the host
    _written(trace)
    trace.swap_out(10, "host", codec="int8")
    # WHEN it comes back labelled fp16 (a stale fp16 copy served, or the wrong label)
    trace.swap_in(10, "device", codec="fp16")
    findings = trace.run()
    # THEN the finding names the block, its sequence and both codecs, with the block's history
    assert rules(findings) == ["codec/precision-regained"]
    f = findings[0]
    assert (f.block, f.seq) == (10, "r1")
    assert f.evidence["codec"] == "fp16" and f.evidence["lossiest_before"] == "int8"
    assert [e["kind"] for e in f.evidence["history"]] == ["alloc", "write", "swap_out"]  # what led to it
    assert f.evidence["events"][0]["kind"] == "swap_in"


def test_recodes_must_lose_precision_work_on_the_latest_copy_and_happen_where_the_block_is(trace):
    trace.start("r1", prompt_len=4)
    trace.alloc(10, "r1", codec="fp16")
    trace.write(10, "r1", 4)  # version 4
    trace.recode(10, "fp16", "nf4")  # a demotion: fine
    trace.recode(10, "nf4", "fp16")  # an upward recode pretends precision
    trace.write(10, "r1", 0, pos=4, version=4)
    trace.alloc(11, "r1", codec="fp16")
    trace.write(11, "r1", 2)  # version 6
    trace.recode(11, "fp16", "int8", version=5)  # an older copy than the last write
    trace.recode(11, "int8", "nf4", tier="host")  # the block is on the device
    assert rules(trace.run()) == ["codec/precision-regained", "codec/recode-misplaced", "codec/recode-stale"]


def test_fp16_and_bf16_rank_alike_and_unknown_codecs_are_not_judged(trace):
    _written(trace, codec="bf16")
    trace.swap_out(10, "host", codec="fp16")
    trace.swap_in(10, "device", codec="fp16")
    trace.alloc(11, "r1", codec="fp8-e4m3")
    trace.swap_out(11, "host", codec="fp32")
    assert trace.run() == []


def test_a_reused_block_id_starts_a_new_codec_life(trace):
    _written(trace)
    trace.recode(10, "fp16", "nf4")
    trace.free(10)
    trace.alloc(10, "r1", codec="fp16")
    trace.swap_out(10, "host", codec="fp16")
    assert trace.run() == []
