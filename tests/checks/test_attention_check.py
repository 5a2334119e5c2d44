"""The attention check: non-finite values at once; outliers, collapse and sink shifts only
after a warm-up and only when they persist — a noisy but healthy run stays silent."""

from __future__ import annotations

import random

from kvdoctor.checks import AttentionSettings
from tracebuilder import TraceBuilder, rules

SETTINGS = AttentionSettings(warmup=40, refresh=20, window=100, persist=3)


def healthy(trace: TraceBuilder, steps: int, seqs=("A", "B"), layers=(0, 1), seed=0, sink=0.3):
    """Noisy, plausible statistics: max logit ~ 8 +- 1, entropy ~ 2 +- 0.2 nats."""
    rng = random.Random(seed)
    for _ in range(steps):
        for s in seqs:
            for layer in layers:
                trace.attn(s, layer, max_logit=rng.gauss(8, 1), entropy=rng.gauss(2, 0.2),
                           sink=sink + rng.uniform(-0.05, 0.05))
        trace.end_step()


def test_nonfinite_scores_are_an_error_at_once(trace):
    trace.attn("A", 3, nonfinite=2)
    trace.attn("A", 3, nonfinite=2)  # the same (sequence, layer): reported once
    trace.attn("B", 5, max_logit=float("nan"))
    findings = trace.run(attention=SETTINGS)
    assert rules(findings) == ["attention/nonfinite", "attention/nonfinite"]
    assert {(f.seq, f.layer, f.severity) for f in findings} == {("A", 3, "error"), ("B", 5, "error")}


def test_near_miss_a_healthy_noisy_run_is_silent(trace):
    healthy(trace, 200, seqs=("A", "B", "C"), layers=(0, 1, 2))
    assert trace.run(attention=SETTINGS) == []


def test_max_logit_outlier_persisting_is_reported(trace):
    healthy(trace, 40)
    for _ in range(3):
        trace.attn("A", 1, max_logit=80.0)
        trace.end_step()
    findings = trace.run(attention=SETTINGS)
    assert rules(findings) == ["attention/max-logit-outlier"]
    f = findings[0]
    assert (f.seq, f.layer, f.severity) == ("A", 1, "warning") and f.evidence["z"] > 10


def test_near_miss_outlier_that_does_not_persist_or_comes_during_warmup(trace):
    trace.attn("A", 1, max_logit=80.0)  # during warm-up
    healthy(trace, 40)
    for value in (80.0, 80.0, 8.0, 80.0):  # never three steps in a row
        trace.attn("A", 1, max_logit=value)
        trace.end_step()
    assert trace.run(attention=SETTINGS) == []


def test_entropy_outlier_persisting_is_reported(trace):
    healthy(trace, 40)
    for _ in range(3):
        trace.attn("B", 0, entropy=9.0)
        trace.end_step()
    assert rules(trace.run(attention=SETTINGS)) == ["attention/entropy-outlier"]


def test_entropy_collapse_is_reported_only_where_the_layer_normally_spreads(trace):
    healthy(trace, 40)
    for _ in range(3):
        trace.attn("A", 0, entropy=0.001)
        trace.end_step()
    findings = trace.run(attention=SETTINGS)
    assert rules(findings) == ["attention/entropy-collapse"]


def test_near_miss_low_entropy_in_a_layer_that_is_always_sharp():
    trace = TraceBuilder()
    rng = random.Random(1)
    for _ in range(60):
        trace.attn("A", 0, entropy=abs(rng.gauss(0.05, 0.03)))
        trace.end_step()
    for _ in range(5):
        trace.attn("A", 0, entropy=0.001)
        trace.end_step()
    assert trace.run(attention=SETTINGS) == []


def test_sink_mass_jump_that_persists_is_reported(trace):
    healthy(trace, 45, sink=0.3)
    for _ in range(3):
        trace.attn("A", 1, sink=0.95)
        trace.end_step()
    findings = trace.run(attention=SETTINGS)
    assert rules(findings) == ["attention/sink-shift"]
    assert (findings[0].seq, findings[0].layer) == ("A", 1)


def test_near_miss_sink_falling_gradually_from_a_full_first_block(trace):
    # while the first block holds every token its mass is 1.0; then it decays step by step
    healthy(trace, 40, seqs=("B",))
    sink = 1.0
    for step in range(60):
        sink = 1.0 if step < 10 else max(0.2, sink - 0.08)
        trace.attn("A", 0, sink=sink)
        trace.end_step()
    assert trace.run(attention=SETTINGS) == []


def test_bad_settings_are_refused():
    import pytest

    with pytest.raises(ValueError, match="attention.persist"):
        AttentionSettings(persist=0)
    with pytest.raises(ValueError, match="attention.refresh"):
        AttentionSettings(window=10, refresh=20)


def test_non_finite_statistics_survive_a_trace_file_and_are_reported(tmp_path):
    # JSON has no NaN: the writer stores null, the reader gives NaN back, the check reports it
    from kvdoctor.events import Attn, Header, TierSpec
    from kvdoctor.trace import TraceReader, TraceWriter

    path = tmp_path / "nan.kvtrace"
    with TraceWriter(path, Header(block_size=4, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=4)])) as w:
        w.write(Attn(seq="A", layer=1, max_logit=float("nan"), entropy=float("inf"), sink=0.5, nonfinite=0,
                     heads_entropy=[1.0, float("nan")]))
    trace = TraceBuilder()
    trace.events = list(TraceReader(path))
    findings = trace.run()
    assert rules(findings) == ["attention/nonfinite"]
    assert (findings[0].seq, findings[0].layer) == ("A", 1)
