"""Settings: `[tool.kvdoctor]` / --config parsed and validated once; every bad value is a
UsageError naming the file and the key."""

from __future__ import annotations

import pytest

from kvdoctor.config import Config, load_config, parse_config
from kvdoctor.errors import UsageError


def test_defaults_when_no_pyproject_says_anything(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert load_config(start=tmp_path) == Config()


def test_sections_build_the_check_settings(tmp_path):
    cfg = parse_config({
        "fail_on": "info", "disable": ["accounting", "attention/sink-shift"],
        "severity": {"leak/usage-mismatch": "warning"}, "max_findings_per_rule": 7, "history": 3,
        "leak": {"grace_steps": 2}, "attention": {"margin": 1, "persist": 5},
    }, "test")
    assert cfg.fail_on == "info" and cfg.leak.grace_steps == 2
    assert cfg.attention.margin == 1.0 and isinstance(cfg.attention.margin, float)
    suite = cfg.make_suite()
    assert [c.name for c in suite.checks] == ["leak", "stale", "batch", "attention", "codec", "integrity", "prefix",
                                             "observer", "weights", "transfer", "adapters", "slots"]
    assert suite.max_per_rule == 7 and suite.severity == {"leak/usage-mismatch": "warning"}


@pytest.mark.parametrize("table, message", [
    ({"fail_on": "fatal"}, "fail_on must be one of error, warning, info"),
    ({"disable": ["leak/no-such-rule"]}, "'leak/no-such-rule' is not a check or a check/rule id"),
    ({"disable": "leak"}, "disable must be a list"),
    ({"severity": {"leak": "warning"}}, "'leak' is not a check/rule id"),
    ({"max_findings_per_rule": 0}, "max_findings_per_rule must be an integer in [1, 1000000]"),
    ({"leak": {"grace": 1}}, "unknown setting leak.grace"),
    ({"leak": {"grace_steps": 1.5}}, "leak.grace_steps must be an integer"),
    ({"attention": {"persist": True}}, "attention.persist must be an integer"),
    ({"attention": {"sink_layers": 2.0}}, "attention.sink_layers must be in (0, 1]"),
    ({"attention_profile": 3}, "attention_profile must be \"auto\", \"none\" or a profile file"),
    ({"attention_profile": "/no/such/profile.json"}, "cannot read attention profile /no/such/profile.json"),
    ({"colour": "red"}, "unknown setting 'colour'"),
])
def test_bad_values_name_the_source_and_key(table, message):
    with pytest.raises(UsageError) as err:
        parse_config(table, "proj/pyproject.toml [tool.kvdoctor]")
    assert message in str(err.value) and str(err.value).startswith("proj/pyproject.toml [tool.kvdoctor]: ")


def test_config_file_may_be_a_pyproject_or_plain_toml(tmp_path):
    plain = tmp_path / "kv.toml"
    plain.write_text('fail_on = "warning"\n')
    assert load_config(plain).fail_on == "warning"
    project = tmp_path / "pyproject.toml"
    project.write_text('[tool.kvdoctor]\nfail_on = "info"\n')
    assert load_config(project).fail_on == "info"
    broken = tmp_path / "broken.toml"
    broken.write_text("fail_on = \n")
    with pytest.raises(UsageError, match="not valid TOML"):
        load_config(broken)


def test_attention_profile_is_chosen_by_the_trace_model_a_file_or_none(tmp_path):
    from kvdoctor.checks import AttentionProfile, ProfileBuilder
    from kvdoctor.events import Attn, Batch

    # GIVEN a profile file next to a config that names it relative to itself
    builder = ProfileBuilder(model="mine")
    builder.feed([Batch(rows=["A"], positions=[0], n=[20]), Attn(seq="A", layer=0, max_logit=5.0, entropy=1.0,
                                                                 sink=0.5, nonfinite=0)])
    builder.profile().save(tmp_path / "mine.json")
    (tmp_path / "kvdoctor.toml").write_text('attention_profile = "mine.json"\n')
    # WHEN configs are loaded THEN the file is read whatever the model; auto takes the shipped one; none nothing
    cfg = load_config(tmp_path / "kvdoctor.toml")
    assert isinstance(cfg.attention_profile_for(None), AttentionProfile)
    assert cfg.attention_profile_for("SmolLM2-135M-Instruct").model == "mine"
    auto = parse_config({}, "test")
    assert auto.attention_profile_for("SmolLM2-135M-Instruct").model == "SmolLM2-135M-Instruct"
    assert auto.attention_profile_for("unknown-model") is None
    assert parse_config({"attention_profile": "none"}, "t").attention_profile_for("SmolLM2-135M-Instruct") is None
    # AND a file that is not a profile is a usage error naming it
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UsageError, match="not a kvdoctor attention profile"):
        auto.with_overrides(attention_profile=str(tmp_path / "bad.json"))
