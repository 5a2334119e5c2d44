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
        "leak": {"grace_steps": 2}, "attention": {"z_threshold": 6, "persist": 5},
    }, "test")
    assert cfg.fail_on == "info" and cfg.leak.grace_steps == 2
    assert cfg.attention.z_threshold == 6.0 and isinstance(cfg.attention.z_threshold, float)
    suite = cfg.make_suite()
    assert [c.name for c in suite.checks] == ["leak", "stale", "batch", "attention", "codec", "integrity"]
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
    ({"attention": {"sink_shift": 2.0}}, "attention.sink_shift must be in (0, 1]"),
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
