"""`kvdoctor check`: exit codes 0/1/2/3, the summary line, the four formats, config and
baselines — driven through the CLI's main() as a user would run it."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

import pytest
from check_traces import clean_events, leaky_events, write_trace

from kvdoctor.cli import main


@pytest.fixture
def leaky(tmp_path):
    return str(write_trace(tmp_path / "leaky.kvtrace", leaky_events()))


@pytest.fixture
def clean(tmp_path):
    return str(write_trace(tmp_path / "clean.kvtrace", clean_events()))


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_clean_trace_exits_0_with_the_summary_as_last_line(capsys, clean):
    code, out, _ = check(capsys, "--trace", clean)
    assert code == 0
    assert out.rstrip().splitlines()[-1] == "KVDOCTOR SUMMARY: 0 errors, 0 warnings, 0 info"


def test_findings_exit_1_and_fail_on_moves_the_bar(capsys, leaky, tmp_path):
    code, out, _ = check(capsys, "--trace", leaky)
    assert code == 1
    assert out.rstrip().splitlines()[-1] == "KVDOCTOR SUMMARY: 1 errors, 1 warnings, 0 info"
    assert "leak/unreachable-swapped" in out and "seq 'r1'" in out and "block 1" in out
    assert "history: alloc@1(device, seq 'r1') -> write@1" in out
    # only the warning remains once the error's rule is disabled: fails at warning, passes at error
    assert check(capsys, "--trace", leaky, "--disable", "leak", "--fail-on", "warning")[0] == 1
    assert check(capsys, "--trace", leaky, "--disable", "leak")[0] == 0


def test_json_report_shape(capsys, leaky):
    code, out, err = check(capsys, "--trace", leaky, "--format", "json")
    doc = json.loads(out)
    assert code == 1 and set(doc) == {"findings", "summary"}
    for f in doc["findings"]:
        assert {"check", "rule", "severity", "message", "seq", "block", "layer", "step", "evidence"} <= set(f)
    leak = next(f for f in doc["findings"] if f["check"] == "leak")
    assert (leak["rule"], leak["seq"], leak["block"], leak["layer"], leak["step"]) == ("unreachable-swapped", "r1", 1, None, 1)
    assert doc["summary"]["errors"] == 1 and doc["summary"]["exit_code"] == 1
    assert err.strip().endswith("KVDOCTOR SUMMARY: 1 errors, 1 warnings, 0 info")


def test_junit_report_fails_one_case_per_failing_finding(capsys, leaky):
    _, out, _ = check(capsys, "--trace", leaky, "--format", "junit")
    suite = ET.fromstring(out).find("testsuite")
    assert suite.get("failures") == "1"
    failed = [c for c in suite.iter("testcase") if c.find("failure") is not None]
    assert [c.get("classname") for c in failed] == ["kvdoctor.leak"]


def test_sarif_points_at_the_trace_line_that_completed_the_finding(capsys, leaky, tmp_path):
    out_file = tmp_path / "k.sarif"
    code, out, err = check(capsys, "--trace", leaky, "--format", "sarif", "--output", str(out_file))
    assert code == 1 and out == "" and "KVDOCTOR SUMMARY" in err
    doc = json.loads(out_file.read_text())
    assert doc["version"] == "2.1.0"
    run = doc["runs"][0]
    result = next(r for r in run["results"] if r["ruleId"] == "leak/unreachable-swapped")
    assert result["level"] == "error"
    assert run["tool"]["driver"]["rules"][result["ruleIndex"]]["id"] == "leak/unreachable-swapped"
    loc = result["locations"][0]["physicalLocation"]
    line = open(leaky).read().splitlines()[loc["region"]["startLine"] - 1]
    assert json.loads(line)["kind"] == "step_end" and json.loads(line)["step"] == 1


def test_unreadable_traces_exit_3(capsys, tmp_path):
    assert check(capsys, "--trace", str(tmp_path / "missing.kvtrace"))[0] == 3
    bad = write_trace(tmp_path / "bad.kvtrace", clean_events(1))
    lines = bad.read_text().splitlines()
    lines[2] = '{"kind": "alloc", "block": "not a number"}'
    bad.write_text("\n".join(lines) + "\n")
    code, _, err = check(capsys, "--trace", str(bad))
    assert code == 3 and ":3:" in err
    v2 = tmp_path / "v2.kvtrace"
    v2.write_text('{"kind":"header","format":"kvdoctor-trace","version":"2.0","block_size":4,"num_layers":1,"tiers":[]}\n')
    assert check(capsys, "--trace", str(v2))[0] == 3


@pytest.mark.parametrize("args", [
    [],  # no source
    ["--trace", "x.kvtrace", "--demo"],  # two sources
    ["--demo", "--fault", "no-such-fault"],
    ["--trace", "x.kvtrace", "--fault", "leak-swapped"],
    ["--trace", "x.kvtrace", "--verify", "full"],
    ["--trace", "x.kvtrace", "--baseline", "missing-baseline.json"],
    ["--trace", "x.kvtrace", "--config", "missing.toml"],
])
def test_usage_errors_exit_2_with_one_line(capsys, args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = check(capsys, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_config_file_and_pyproject(capsys, leaky, tmp_path, monkeypatch):
    cfg = tmp_path / "kv.toml"
    cfg.write_text('fail_on = "warning"\ndisable = ["leak"]\n')
    assert check(capsys, "--trace", leaky, "--config", str(cfg))[0] == 1  # the warning now fails
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.kvdoctor]\ndisable = ["leak/unreachable-swapped"]\n')
    monkeypatch.chdir(project)
    code, out, _ = check(capsys, "--trace", leaky)
    assert code == 0 and "unreachable-swapped" not in out
    (project / "pyproject.toml").write_text('[tool.kvdoctor.attention]\nmargin = -1\n')
    code, _, err = check(capsys, "--trace", leaky)
    assert code == 2 and "margin must be >= 0" in err


def test_baseline_accepts_known_findings_and_only_new_ones_fail(capsys, leaky, tmp_path):
    baseline = tmp_path / "baseline.json"
    assert check(capsys, "--trace", leaky, "--write-baseline", str(baseline))[0] == 0
    code, out, _ = check(capsys, "--trace", leaky, "--baseline", str(baseline))
    assert code == 0 and "2 findings accepted by the baseline" in out
    more = write_trace(tmp_path / "more.kvtrace", leaky_events()[:-1] + [
        ev for ev in __import__("check_traces").request("r9", 9, step=5, leak=True)])
    code, out, _ = check(capsys, "--trace", str(more), "--baseline", str(baseline))
    assert code == 1 and "seq 'r9'" in out and "seq 'r1'" not in out


def test_list_rules(capsys):
    code, out, _ = check(capsys, "--list-rules")
    assert code == 0 and "leak/unreachable-swapped" in out and "attention/nonfinite" in out


def test_check_a_workload_command(capsys, tmp_path):
    from test_session import WORKLOAD

    tests = str(__import__("pathlib").Path(__file__).parent)
    code, out, _ = check(capsys, "--format", "json", "--", sys.executable, "-c", WORKLOAD.format(tests=tests, code=0))
    doc = json.loads(out)  # the workload's own output went to stderr
    assert code == 1
    assert {f["rule"] for f in doc["findings"]} == {"unreachable-swapped", "unknown-block"}
    assert "workload finished (exit 0)" in doc["summary"]["notes"]


def test_a_failing_workload_is_an_error_finding(capsys, tmp_path):
    from test_session import WORKLOAD

    tests = str(__import__("pathlib").Path(__file__).parent)
    code, out, _ = check(capsys, "--format", "json", "--disable", "leak", "--disable", "accounting",
                         "--", sys.executable, "-c", WORKLOAD.format(tests=tests, code=3))
    doc = json.loads(out)
    assert code == 1
    assert [(f["check"], f["rule"]) for f in doc["findings"]] == [("workload", "exit-status")]
    assert "(exit 3)" in doc["findings"][0]["message"] and doc["summary"]["suppressed"] == 0
