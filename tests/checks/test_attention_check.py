"""The attention check: non-finite values at once; logits above the model's normal range (a learned
profile, or the trace's own ranges without one); entropy beyond what the keys can hold; collapse and
sink shifts only where a healthy model cannot produce them — a healthy run stays silent."""

from __future__ import annotations

import math
import random

import pytest

from kvdoctor.checks import AttentionProfile, AttentionSettings, ProfileBuilder
from kvdoctor.checks.attention_profile import bucket_of
from tracebuilder import TraceBuilder, rules

SETTINGS = AttentionSettings(warmup=40, persist=3)
LAYERS = (0, 1, 2, 3)


def healthy(trace: TraceBuilder, steps: int, seqs=("A", "B"), layers=LAYERS, seed=0, start=64, sink=0.4):
    """Plausible statistics of a growing sequence: max logit ~ 8 +- 1, entropy growing with the number
    of keys (about 0.4 log keys +- 0.15), sink mass decaying slowly, one batch row per sequence per step."""
    rng = random.Random(seed)
    for i in range(steps):
        keys = start + i
        trace.batch(seqs, positions=[keys - 1] * len(seqs))
        for s in seqs:
            for layer in layers:
                trace.attn(s, layer, max_logit=rng.gauss(8, 1), entropy=0.4 * math.log(keys) + rng.gauss(0, 0.15),
                           sink=sink * 64 / (64 + i) + rng.uniform(-0.03, 0.03))
        trace.end_step()
    return start + steps


def run(trace: TraceBuilder, **kw):
    """Only the attention check judges these events (their batches have no sequences behind them)."""
    return trace.run(disabled=["batch"], attention=kw.pop("settings", SETTINGS), **kw)


def learned(steps=200, seed=7, start=16) -> AttentionProfile:
    """A profile learned from a clean trace of the same kind (another seed)."""
    t = TraceBuilder()
    healthy(t, steps, seqs=("P", "Q", "R"), seed=seed, start=start)
    builder = ProfileBuilder(model="toy")
    builder.feed(t.events)
    return builder.profile()


def decode(trace: TraceBuilder, keys: int, seq="A", layers=LAYERS, **stats):
    """One decode step of ``seq`` at ``keys`` keys with the given statistics in every listed layer."""
    trace.batch([seq], positions=[keys - 1])
    for layer in layers:
        trace.attn(seq, layer, **{"max_logit": 8.0, "entropy": 0.4 * math.log(keys), "sink": 0.3, **stats})
    trace.end_step()


# ---- non-finite ------------------------------------------------------------------------------------


def test_nonfinite_scores_are_an_error_at_once(trace):
    trace.attn("A", 3, nonfinite=2)
    trace.attn("A", 3, nonfinite=2)  # the same (sequence, layer): reported once
    trace.attn("B", 5, max_logit=float("nan"))
    findings = trace.run(attention=SETTINGS)
    # THEN one error, at the first layer that went non-finite; the other is counted as its cascade
    assert rules(findings) == ["attention/nonfinite"]
    (f,) = findings
    assert (f.seq, f.layer, f.severity) == ("A", 3, "error")
    assert f.evidence["cascade"] == {"count": 1, "rules": {"attention/nonfinite": 1}, "sequences": ["B"],
                                     "num_sequences": 1, "layers": [5, 5], "steps": [0, 0]}


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "through-a-shared-block"])
def test_a_nan_below_every_earlier_one_is_a_cause_of_its_own(trace, shared):
    # GIVEN a NaN in A from layer 7 at step 0, and later one in C from layer 3: a sequence of its own, or one
    # sharing A's block
    trace.start("A", 4)
    trace.alloc(0, "A")
    trace.start("C", 4)
    if shared:
        trace.share(0, "C")
    else:
        trace.alloc(1, "C")
    trace.attn("A", 7, nonfinite=2)
    trace.attn("A", 8, nonfinite=2)  # A's layers above it: the same NaN
    for _ in range(5):
        trace.end_step()
    trace.attn("C", 3, nonfinite=1)
    trace.end_step()
    found = trace.run(disabled=["batch", "leak"], attention=SETTINGS)
    # THEN a NaN that A's could have reached is counted under it; one it could not (a layer below, nothing
    # shared) is an error of its own
    assert [(f.seq, f.layer) for f in found] == ([("A", 7)] if shared else [("A", 7), ("C", 3)])


def test_a_nan_at_the_same_layer_or_above_in_another_request_is_the_same_cause(trace):
    # GIVEN requests that share nothing: A non-finite from layer 15, later B from 15 and C from 18 only
    for step, seq, layer in ((0, "A", 15), (20, "B", 15), (30, "C", 18)):
        while trace.step < step:
            trace.end_step()
        trace.attn(seq, layer, nonfinite=3)
        trace.attn(seq, layer + 1, nonfinite=3)
    trace.end_step()
    found = trace.run(disabled=["batch", "leak"], attention=SETTINGS)
    # THEN one error, at the lowest layer: the others are what a NaN flowing up the layers leaves
    assert [(f.seq, f.layer) for f in found] == [("A", 15)]
    assert found[0].evidence["cascade"]["sequences"] == ["B", "C"]


# ---- near misses: healthy behaviour that the first version of this check reported --------------------


def test_near_miss_a_healthy_noisy_run_is_silent_with_and_without_a_profile(trace):
    healthy(trace, 300, seqs=("A", "B", "C"))
    assert run(trace) == []
    assert run(trace, attention_profile=learned()) == []


def test_near_miss_a_longer_sequence_than_ever_before_spreads_wider_and_is_silent(trace):
    # GIVEN a trace (and a profile) of sequences up to ~260 keys, WHEN a 1500-key prompt comes
    # (entropy grows with the number of keys), THEN nothing is reported
    end = healthy(trace, 200, seqs=("A",))
    for keys in (1500, 1501, 1502):
        decode(trace, keys, seq="L")
    assert end < 1500
    assert run(trace) == []
    assert run(trace, attention_profile=learned()) == []


def test_near_miss_sink_mass_of_one_layer_drifting_far_is_silent(trace):
    # the example: layer 4 of one sequence, sink mass from 0.707 to 0.109, staying there
    healthy(trace, 60, seqs=("A",), layers=range(6), sink=0.7)
    for i in range(6):
        trace.batch(["A"], positions=[124 + i])
        for layer in range(6):
            trace.attn("A", layer, entropy=0.4 * math.log(125 + i), sink=0.109 if layer == 4 else 0.45)
        trace.end_step()
    assert run(trace) == []


# ---- max logit ----------------------------------------------------------------------------------


def test_exploding_logits_outside_the_profile_are_reported_naming_the_layer(trace):
    # GIVEN a profile where layer 1 never scores above ~12
    profile = learned()
    healthy(trace, 10, seqs=("A",))
    # WHEN a sequence's keys in layer 1 make scores of 80 for three steps (a wrong scale, garbage K)
    for i in range(3):
        decode(trace, 80 + i, layers=(1,), max_logit=80.0)
    findings = run(trace, attention_profile=profile)
    # THEN one warning names the sequence and layer, with the normal range as evidence
    assert rules(findings) == ["attention/max-logit-outlier"]
    f = findings[0]
    assert (f.seq, f.layer, f.severity) == ("A", 1, "warning")
    assert f.evidence["value"] == 80.0 and f.evidence["normal"][1] < 14 and f.evidence["profile"] == "toy"
    assert f.evidence["allowed_max"] < 20
    assert "profile of toy" in f.message


def test_near_miss_low_logits_and_uniform_attention_are_no_evidence(trace):
    # a prompt of one special token repeated (SmolLM2's <|endoftext|> x 40) gives near-zero keys: the
    # largest score near 0 and attention exactly uniform over every key, as zeroed keys would
    for i in range(4):
        decode(trace, 40 + i, layers=(2,), max_logit=0.2, entropy=math.log(40 + i))
    assert run(trace, attention_profile=learned()) == []
    assert run(trace) == []


def test_without_a_profile_the_trace_own_range_judges_after_warmup(trace):
    healthy(trace, 60, seqs=("A",))
    for i in range(3):
        decode(trace, 124 + i, layers=(0,), max_logit=80.0)
    findings = run(trace)
    assert rules(findings) == ["attention/max-logit-outlier"]
    assert "this trace's own range" in findings[0].message


def test_near_miss_outlier_that_does_not_persist_or_comes_during_warmup(trace):
    decode(trace, 64, layers=(1,), max_logit=80.0)  # during warm-up: nothing to judge against
    healthy(trace, 60, seqs=("A",))
    for value in (80.0, 80.0, 8.0, 80.0):  # never three observations in a row
        decode(trace, 130, layers=(1,), max_logit=value)
    assert run(trace) == []


def test_near_miss_a_logit_just_past_the_profile_max_is_within_the_margin(trace):
    profile = learned()
    hi = profile.layers[1].logit.hi
    for i in range(4):
        decode(trace, 100 + i, layers=(1,), max_logit=hi + 1.0)
    assert run(trace, attention_profile=profile) == []


# ---- entropy -------------------------------------------------------------------------------------


def test_more_entropy_than_the_keys_can_hold_is_reported_without_any_profile(trace):
    # GIVEN a sequence of 100 keys, WHEN a layer's attention has more entropy than log(100) = 4.6 nats for
    # three steps (it spread over keys the sequence does not have: a mask or block-table bug)
    for i in range(3):
        decode(trace, 100 + i, layers=(0,), entropy=math.log(100 + i) + 0.5)
    findings = run(trace)  # no profile and no warm-up needed: it is a bound of arithmetic
    # THEN an entropy outlier names the layer, with the bound as evidence
    assert rules(findings) == ["attention/entropy-outlier"]
    f = findings[0]
    assert (f.seq, f.layer, f.evidence["keys"]) == ("A", 0, 102)
    assert f.evidence["max_entropy"] == pytest.approx(math.log(102))


def test_near_miss_entropy_at_the_bound_within_rounding(trace):
    for i in range(4):
        decode(trace, 100 + i, layers=(0,), entropy=math.log(100 + i) + 0.005)
    assert run(trace) == []


def test_entropy_collapse_is_reported_only_where_the_layer_never_collapses(trace):
    for i in range(3):
        decode(trace, 100 + i, layers=(0,), entropy=0.001)
    findings = run(trace, attention_profile=learned())
    assert rules(findings) == ["attention/entropy-collapse"]
    assert findings[0].evidence["floor"] > 0.5


def test_near_miss_low_entropy_in_a_layer_that_is_always_sharp():
    trace = TraceBuilder()
    rng = random.Random(1)
    for i in range(80):
        trace.batch(["A"], positions=[100 + i])
        trace.attn("A", 0, entropy=abs(rng.gauss(0.05, 0.03)))
        trace.end_step()
    for i in range(5):
        decode(trace, 200 + i, layers=(0,), entropy=0.001, max_logit=5.0)
    assert run(trace) == []


def test_near_miss_one_key_is_all_a_short_sequence_has(trace):
    # a query that sees a handful of keys may put everything on one: not a collapse
    healthy(trace, 60, seqs=("B",))
    for keys in (3, 4, 5, 6):
        decode(trace, keys, seq="S", layers=(0,), entropy=0.0, max_logit=8.0)
    assert "attention/entropy-collapse" not in rules(run(trace, attention_profile=learned(start=3)))


# ---- sink shift -------------------------------------------------------------------------------------


def test_sink_mass_falling_in_every_layer_at_once_and_staying_is_reported(trace):
    # GIVEN a sequence whose layers hold 0.3-0.5 of their mass on the first block
    healthy(trace, 60, seqs=("A",), layers=range(8), sink=0.45)
    # WHEN at one step the mass falls to 0.01 in every layer (its first block swapped for garbage) and stays
    for i in range(3):
        decode(trace, 124 + i, layers=range(8), sink=0.01)
    findings = run(trace)
    # THEN one finding for the sequence, with every layer's level and new mass as evidence
    assert rules(findings) == ["attention/sink-shift"]
    f = findings[0]
    assert (f.seq, f.layer, f.evidence["layers_moved"], f.evidence["num_layers"]) == ("A", None, 8, 8)


def test_near_miss_sink_mass_falling_everywhere_for_one_token_only(trace):
    healthy(trace, 60, seqs=("A",), layers=range(8), sink=0.45)
    decode(trace, 124, layers=range(8), sink=0.01)
    for i in range(4):
        decode(trace, 125 + i, layers=range(8), sink=0.28)
    assert run(trace) == []


# ---- profiles -------------------------------------------------------------------------------------------


def test_profile_survives_a_file_and_keeps_its_ranges(tmp_path):
    profile = learned()
    path = tmp_path / "toy.json"
    profile.save(path)
    again = AttentionProfile.load(path)
    assert again.model == "toy" and again.layers == profile.layers and again.num_events == profile.num_events


def test_a_profile_learns_entropy_per_key_count_bucket():
    profile = learned(steps=400, start=16)
    layer = profile.layers[0]
    assert bucket_of(16) == 0 and bucket_of(17) == 1 and bucket_of(1500) == 7
    assert set(layer.entropy) == {0, 1, 2, 3, 4, 5}  # 16 .. 415 keys
    assert layer.entropy[5].lo > layer.entropy[1].hi  # entropy grows with the number of keys
    # beyond the longest bucket learned, the upper end grows by at most log 2 per doubling
    assert layer.entropy_span(7).hi == pytest.approx(layer.entropy[5].hi + 2 * math.log(2))


@pytest.mark.parametrize("data, match", [
    ({"format": "other"}, "not a kvdoctor attention profile"),
    ({"format": "kvdoctor-attention-profile", "version": 9, "layers": {}}, "version 9"),
    ({"format": "kvdoctor-attention-profile", "version": 1, "layers": {"0": {"n": 1, "logit": [1, 2]}}}, "malformed"),
    ({"format": "kvdoctor-attention-profile", "version": 1, "layers": {}}, "no layers"),
])
def test_a_malformed_profile_is_refused_with_its_reason(data, match):
    with pytest.raises(ValueError, match=match):
        AttentionProfile.from_dict(data)


def test_the_embedded_model_has_a_shipped_profile():
    from kvdoctor.checks import shipped_profile

    profile = shipped_profile("SmolLM2-135M-Instruct")
    assert profile is not None and len(profile.layers) == 30 and profile.num_events > 50_000
    assert shipped_profile("some-other-model") is None and shipped_profile(None) is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="attention.persist"):
        AttentionSettings(persist=0)
    with pytest.raises(ValueError, match="attention.sink_layers"):
        AttentionSettings(sink_layers=1.5)


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
