"""`kvdoctor attention-profile`: a model's normal attention learned from clean traces, then used by
`kvdoctor check --attention-profile` to catch exploding logits that a fresh trace cannot judge alone."""

from __future__ import annotations

import json
import random

from check_traces import write_trace

import kvdoctor.events as E
from kvdoctor.cli import main


def decoding(seq: str, steps: int, *, seed: int = 0, logit=None) -> list[E.Event]:
    """``seq`` decoding ``steps`` tokens after a 40-token prompt: one batch and two layers of statistics a step."""
    rng = random.Random(seed)
    out: list[E.Event] = []
    for i in range(steps):
        out.append(E.Batch(step=i, rows=[seq], positions=[40 + i], n=[1]))
        for layer in range(2):
            out.append(E.Attn(step=i, seq=seq, layer=layer, entropy=1.5 + rng.gauss(0, 0.1), sink=0.4, nonfinite=0,
                              max_logit=logit if logit is not None else 8.0 + rng.gauss(0, 1)))
    return out


def test_a_profile_learned_from_clean_traces_catches_exploding_logits_in_a_short_trace(tmp_path, capsys):
    # GIVEN two clean traces of a model
    clean = [write_trace(tmp_path / f"clean{i}.kvtrace", decoding("A", 80, seed=i)) for i in range(2)]
    out = tmp_path / "toy.json"
    # WHEN a profile is learned from them
    assert main(["attention-profile", *map(str, clean), "-o", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["format"] == "kvdoctor-attention-profile" and set(profile["layers"]) == {"0", "1"}
    assert profile["num_events"] == 320 and "wrote" in capsys.readouterr().err
    # THEN a trace too short to judge by itself is judged against it: logits of 60 are reported
    bad = str(write_trace(tmp_path / "bad.kvtrace", decoding("B", 4, logit=60.0)))
    assert main(["check", "--trace", bad, "--fail-on", "warning"]) == 0  # nothing to compare with
    capsys.readouterr()
    assert main(["check", "--trace", bad, "--fail-on", "warning", "--attention-profile", str(out),
                 "--format", "json"]) == 1
    found = json.loads(capsys.readouterr().out)["findings"]
    assert {(f["rule"], f["layer"]) for f in found} == {("max-logit-outlier", 0), ("max-logit-outlier", 1)}


def test_a_trace_with_non_finite_attention_is_not_clean_and_is_refused(tmp_path, capsys):
    events = decoding("A", 3) + [E.Attn(step=3, seq="A", layer=0, max_logit=1.0, entropy=1.0, sink=0.5, nonfinite=2)]
    path = write_trace(tmp_path / "nan.kvtrace", events)
    assert main(["attention-profile", str(path), "-o", str(tmp_path / "p.json")]) == 2
    assert "not a clean trace" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_trace_without_statistics_or_a_missing_one_is_a_one_line_error(tmp_path, capsys):
    empty = write_trace(tmp_path / "empty.kvtrace", [E.SeqStart(seq="A", prompt_len=3)])
    assert main(["attention-profile", str(empty), "-o", str(tmp_path / "p.json")]) == 2
    assert "no finite attn events" in capsys.readouterr().err
    assert main(["attention-profile", str(tmp_path / "missing.kvtrace"), "-o", str(tmp_path / "p.json")]) == 3
