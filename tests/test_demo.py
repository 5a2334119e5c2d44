"""The demo workload behind `kvdoctor watch --demo`, on the tiny random model: its codec setting reaches the
engine and the trace, and a setting it cannot honour is one line and exit status 2."""

from __future__ import annotations

from kvdoctor.checks import make_suite
from kvdoctor.demo import DemoConfig, main, run_demo
from kvdoctor.events import PREFIX_CACHE, Merge, Share, StepEnd, SwapOut
from kvdoctor.trace import TraceReader


def test_per_tier_codecs_reach_the_trace_and_the_checks_find_nothing(tmp_path, monkeypatch):
    # GIVEN the demo with a small device tier at fp32 and a host tier at fp16, traced
    path = tmp_path / "demo.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    # WHEN it serves for a while (preempting and swapping requests to the host)
    run_demo(DemoConfig(model="tiny", steps=40, device_blocks=8, codec="device=fp32,host=fp16"))
    reader = TraceReader(path)
    events = list(reader)
    # THEN the header names each tier's codec, blocks went down re-encoded as fp16, and nothing is wrong
    assert [(t.name, t.codec) for t in reader.header.tiers] == [("device", "fp32"), ("host", "fp16")]
    swaps = [e for e in events if isinstance(e, SwapOut)]
    assert swaps and {e.codec for e in swaps} == {"fp16"}
    suite = make_suite()
    for e in events:
        suite.observe(e)
    assert suite.findings + suite.finish() == []


def test_a_codec_that_needs_calibration_text_is_refused_for_a_model_without_tokenizer(capsys):
    assert main(["--model", "tiny", "--steps", "1", "--codec", "int8"]) == 2
    err = capsys.readouterr().err
    assert "calibrates on text" in err and len(err.strip().splitlines()) == 1


def test_prefix_cache_demo_serves_the_shared_system_prompt_from_the_cache_and_stays_clean(tmp_path, monkeypatch):
    # GIVEN the demo with its prefix cache, traced, on a device tier small enough to preempt and evict
    path = tmp_path / "prefix.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    # WHEN it serves for a while
    run_demo(DemoConfig(model="tiny", steps=30, device_blocks=12, max_new_tokens=20, prefix_cache=True))
    events = list(TraceReader(path))
    # THEN the requests admitted after the first wave (which all start in step 0, before anything is cached)
    # were served the system prompt's 3 blocks from the cache, the cache holds blocks, and the checks find nothing
    ends = [e for e in events if isinstance(e, StepEnd) and e.prefix_hits is not None]
    assert len(ends) == 30 and ends[0].prefix_hits == 0 and sum(e.prefix_hits for e in ends) >= 3
    assert any(isinstance(e, Share) and e.seq == PREFIX_CACHE and e.hash for e in events)
    suite = make_suite()
    for e in events:
        suite.observe(e)
    assert suite.findings + suite.finish() == []


def test_merging_demo_with_swaps_and_speculative_rollbacks_stays_clean(tmp_path, monkeypatch):
    # GIVEN the demo merging old blocks (a threshold the tiny model's keys reach), drafting speculatively,
    # on a device tier small enough to preempt and swap, traced
    path = tmp_path / "merge.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    # WHEN it serves for a while
    run_demo(DemoConfig(model="tiny", steps=30, device_blocks=10, merge=0.3, speculative=True))
    events = list(TraceReader(path))
    # THEN blocks were merged and moved between tiers (some merged ones too), and the checks find nothing
    merged = {e.block for e in events if isinstance(e, Merge)}
    assert merged and any(isinstance(e, SwapOut) for e in events)
    suite = make_suite()
    for e in events:
        suite.observe(e)
    assert suite.findings + suite.finish() == []
