"""Reports: one set of findings rendered as text, JSON, JUnit and SARIF, failing at ``fail_on``, and
baselines that accept known findings so CI fails only on new ones."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter

import msgspec
import pytest

from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, UsageError
from kvdoctor.findings import Finding, drawn_id
from kvdoctor.report import (
    FORMATS, Report, apply_baseline, load_baseline, render, summary_line, write_baseline,
)
from kvdoctor.report_html import render_html

LEAK = Finding(check="leak", rule="unreachable-swapped", severity="error", message="block 3 leaked on host",
               seq="r1", block=3, step=7, evidence={
                   "event_index": 41,
                   "history": [{"kind": "alloc", "step": 2, "tier": "device", "seq": "r1"},
                               {"kind": "swap_out", "step": 5, "src": "device", "dst": "host", "version": 16},
                               {"kind": "seq_end", "step": 7, "seq": "r1"}]})
UNKNOWN = Finding(check="accounting", rule="unknown-block", severity="warning", message="free of block 9",
                  block=9, step=1)
NOTE = Finding(check="attention", rule="entropy-collapse", severity="info", message="layer 2 looks at one key",
               seq="r2", layer=2, step=3)


def report(**kw) -> Report:
    return Report([NOTE, LEAK, UNKNOWN], source="run.kvtrace", trace_path="traces/run.kvtrace", num_events=120, **kw)


def test_findings_are_ordered_by_severity_then_step_and_counted():
    r = report()
    assert [f.rule for f in r.findings] == ["unreachable-swapped", "unknown-block", "entropy-collapse"]
    assert r.counts() == {"error": 1, "warning": 1, "info": 1}
    assert summary_line(r) == "KVDOCTOR SUMMARY: 1 errors, 1 warnings, 1 info"


@pytest.mark.parametrize("fail_on, failing, code", [
    ("error", ["unreachable-swapped"], EXIT_FINDINGS),
    ("warning", ["unreachable-swapped", "unknown-block"], EXIT_FINDINGS),
    ("info", ["unreachable-swapped", "unknown-block", "entropy-collapse"], EXIT_FINDINGS),
])
def test_what_fails_a_run_is_what_reaches_fail_on(fail_on, failing, code):
    r = report(fail_on=fail_on)
    assert [f.rule for f in r.failing()] == failing and r.exit_code == code
    assert Report([UNKNOWN, NOTE], fail_on="error").exit_code == EXIT_OK


def test_text_says_where_each_finding_is_and_tells_the_block_story():
    # GIVEN a report of a cut trace with a note and findings past the cap
    text = render(report(truncated=True, suppressed=4, baselined=2, notes=["workload finished (exit 0)"]), "text")
    lines = text.splitlines()
    # THEN the head names the source and the cut, then the notes, each finding, the counts, the summary last
    assert lines[0] == "kvdoctor check: run.kvtrace: 120 events (last line cut short)"
    assert lines[1] == "note: workload finished (exit 0)"
    assert "ERROR   leak/unreachable-swapped  step 7  seq 'r1'  block 3" in lines
    assert ("        history: alloc@2(device, seq 'r1') -> swap_out@5 device->host v16 -> seq_end@7(seq 'r1')"
            in lines)
    assert "4 further findings over the per-rule cap were counted but not listed" in lines
    assert "2 findings accepted by the baseline were not listed" in lines
    assert lines[-1] == summary_line(report())


def test_json_is_the_findings_and_the_summary():
    doc = json.loads(render(report(fail_on="warning", notes=["n"]), "json"))
    assert [f["rule"] for f in doc["findings"]] == ["unreachable-swapped", "unknown-block", "entropy-collapse"]
    first = doc["findings"][0]
    assert (first["seq"], first["block"], first["layer"], first["step"]) == ("r1", 3, None, 7)
    assert first["evidence"]["event_index"] == 41
    assert doc["summary"] == {
        "errors": 1, "warnings": 1, "info": 1, "fail_on": "warning", "failed": True, "exit_code": EXIT_FINDINGS,
        "events": 120, "truncated": False, "suppressed": 0, "baselined": 0, "source": "run.kvtrace", "notes": ["n"],
    }


def test_junit_fails_a_case_per_failing_finding_and_passes_the_quiet_checks():
    root = ET.fromstring(render(report(), "junit").split("\n", 1)[1])
    suite = root.find("testsuite")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    # THEN the error fails, the warning and the info are told but pass, and every quiet check has its case
    assert cases["unreachable-swapped seq 'r1'  block 3"].find("failure") is not None
    assert cases["unknown-block block 9"].find("failure") is None
    assert "stale: no findings" in cases and "leak: no findings" not in cases
    assert (suite.get("tests"), suite.get("failures")) == (str(len(cases)), "1")


def test_sarif_points_each_result_at_its_rule_and_trace_line():
    run = json.loads(render(report(), "sarif"))["runs"][0]
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    leak = next(r for r in run["results"] if r["ruleId"] == "leak/unreachable-swapped")
    assert rules[leak["ruleIndex"]] == "leak/unreachable-swapped" and leak["level"] == "error"
    # event 41 is line 43: the header is line 1
    assert leak["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "traces/run.kvtrace"}, "region": {"startLine": 43}}
    assert leak["partialFingerprints"] == {"kvdoctor/v2": f"{LEAK.key}:1"}
    info = next(r for r in run["results"] if r["ruleId"] == "attention/entropy-collapse")
    assert info["level"] == "note" and "region" not in info["locations"][0]["physicalLocation"]


ALLOCATED = msgspec.structs.replace(LEAK, stacks={
    "alloc": ["app.py:12 serve", "app.py:30 <module>"], "seq_end": ["app.py:19 cancel"]})


def test_a_finding_with_stacks_names_the_users_line_in_every_format():
    r = Report([ALLOCATED], source="python app.py", trace_path="traces/run.kvtrace")
    # THEN the text says where the block was allocated and where its sequence ended
    lines = render(r, "text").splitlines()
    assert "        allocated at app.py:12 in serve <- app.py:30 in <module>" in lines
    assert "        sequence ended at app.py:19 in cancel" in lines
    # and the JSON carries the frames as recorded
    assert json.loads(render(r, "json"))["findings"][0]["stacks"]["alloc"][0] == "app.py:12 serve"
    # SARIF's primary location is the user's line; the abort and the trace event are related locations
    result = json.loads(render(r, "sarif"))["runs"][0]["results"][0]
    assert result["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "app.py"}, "region": {"startLine": 12}}
    assert [loc["physicalLocation"]["artifactLocation"]["uri"] for loc in result["relatedLocations"]] == [
        "app.py", "app.py", "traces/run.kvtrace"]
    # JUnit's case carries file and line, as pytest's own do, and the stack in its failure
    case = next(c for c in ET.fromstring(render(r, "junit").split("\n", 1)[1]).iter("testcase")
                if c.find("failure") is not None)
    assert (case.get("file"), case.get("line")) == ("app.py", "12")
    assert "allocated at app.py:12 in serve" in case.find("failure").text
    assert "allocated at app.py:12 in serve" in render_html(r)


def test_a_fingerprint_is_the_rule_what_and_where_never_the_step():
    # GIVEN the same leak found at another step, and a leak of the same block allocated elsewhere
    later = msgspec.structs.replace(ALLOCATED, step=70, message="block 3 leaked on host at 70")
    elsewhere = msgspec.structs.replace(ALLOCATED, stacks={"alloc": ["app.py:40 batch"]})
    # THEN the step and the message change nothing; the user's line and the tier do
    assert later.key == ALLOCATED.key != elsewhere.key
    assert "at=app.py:12" in ALLOCATED.key and "step" not in ALLOCATED.key
    mismatch = Finding(check="leak", rule="usage-mismatch", severity="error", message="m", evidence={"tier": "host"})
    assert mismatch.key != msgspec.structs.replace(mismatch, evidence={"tier": "disk"}).key
    # AND two findings of one key stay two alerts in SARIF, and two cases in JUnit
    r = Report([mismatch, mismatch])
    results = json.loads(render(r, "sarif"))["runs"][0]["results"]
    assert [x["partialFingerprints"]["kvdoctor/v2"] for x in results] == [f"{mismatch.key}:1", f"{mismatch.key}:2"]
    names = [c.get("name") for c in ET.fromstring(render(r, "junit").split("\n", 1)[1]).iter("testcase")]
    assert "usage-mismatch" in names and "usage-mismatch #2" in names


def test_a_fingerprint_names_a_random_request_id_by_its_place_in_the_trace():
    import uuid

    from kvdoctor.checks import make_suite
    from kvdoctor.events import Alloc, SeqEnd, SeqStart, StepEnd, SwapOut

    def leak_of(ids: list[str]) -> list[str]:
        """A server's run: three requests, the second leaking a swapped-out block when it ends."""
        events = [e for i, seq in enumerate(ids) for e in (SeqStart(seq=seq, prompt_len=4, step=i),
                                                           Alloc(block=i, tier="device", seq=seq, step=i))]
        events += [SwapOut(block=1, src="device", dst="host", version=0, step=3), SeqEnd(seq=ids[1], step=3),
                   StepEnd(step=3, num_tokens=1)]
        suite = make_suite()
        return [f.key for f in suite.observe_many(events) + list(suite.finish()) if f.block == 1]

    # GIVEN two runs of one workload whose server draws request ids at random (vLLM's "cmpl-<uuid>-0")
    first, second = ([f"cmpl-{uuid.uuid4().hex}-0" for _ in range(3)] for _ in range(2))
    # THEN the leak's fingerprint is the same in both: the request is named by its place, the second to start
    assert leak_of(first) == leak_of(second) and leak_of(first) and "seq=#1/" in leak_of(first)[0]
    # AND an id the workload chose itself (a counter, a name) stays in the fingerprint as it is
    assert "seq=req-1/" in leak_of(["req-0", "req-1", "req-2"])[0]
    # AND vLLM 0.32's own ids (the caller's id and 8 random hex digits) count as drawn, however they fall
    assert [drawn_id(s) for s in ("0-3fa2b91c", "12-90817263", "0-abcdef12", "gen1.row0", "deadbeef", 7)] == [
        True, True, True, False, False, False]


def test_an_unknown_format_is_a_usage_error_naming_the_formats():
    with pytest.raises(UsageError, match="unknown format 'html': use one of " + ", ".join(FORMATS)):
        render(report(), "html")


def test_a_baseline_accepts_as_many_of_each_finding_as_it_lists(tmp_path):
    # GIVEN a baseline written from one leak
    path = tmp_path / "baseline.json"
    assert write_baseline(path, [LEAK]) == 1
    accepted = load_baseline(path)
    assert accepted == Counter({LEAK.key: 1})
    # WHEN the same leak comes twice, beside a new finding
    kept, dropped = apply_baseline([LEAK, UNKNOWN, LEAK], accepted)
    # THEN one leak is accepted; the second and the new finding are kept
    assert (kept, dropped) == ([UNKNOWN, LEAK], 1)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "is not readable JSON"),
    ('{"format": "other", "findings": []}', "is not a kvdoctor baseline"),
    ('{"format": "kvdoctor-baseline", "findings": [{"check": "leak"}]}', "needs a string 'key'"),
])
def test_a_bad_baseline_is_a_usage_error_saying_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_baseline(path)


def test_every_format_names_the_trace_a_finding_came_from():
    # GIVEN a finding read from the second of a workload's traces
    second = msgspec.structs.replace(LEAK, trace="out/workload.2.kvtrace")
    r = Report([second], source="python app.py", trace_path="out/workload.kvtrace")
    # THEN text, JSON, JUnit, SARIF and HTML all say which file to open
    assert "ERROR   leak/unreachable-swapped  step 7  seq 'r1'  block 3  trace out/workload.2.kvtrace" in render(
        r, "text").splitlines()
    assert json.loads(render(r, "json"))["findings"][0]["trace"] == "out/workload.2.kvtrace"
    names = [c.get("name") for c in ET.fromstring(render(r, "junit").split("\n", 1)[1]).iter("testcase")]
    assert any("trace out/workload.2.kvtrace" in n for n in names)
    result = json.loads(render(r, "sarif"))["runs"][0]["results"][0]
    related = result["relatedLocations"][0]["physicalLocation"]
    assert related == {"artifactLocation": {"uri": "out/workload.2.kvtrace"}, "region": {"startLine": 43}}
    assert "trace out/workload.2.kvtrace" in render_html(r)


def test_a_cascade_is_one_finding_with_a_count_and_symptoms_come_after_causes():
    # GIVEN a NaN at layer 15 that every later layer of two sequences inherits, and a usage count that is off
    from kvdoctor.checks import make_suite
    from kvdoctor.events import Attn, Usage

    suite = make_suite()
    events = [Usage(t=0, step=0, tier="host", used_blocks=3, capacity_blocks=8)]
    events += [Attn(t=1, step=2, seq=seq, layer=layer, max_logit=5.2365617752075195, entropy=1.0, sink=0.5,
                    nonfinite=3) for seq in (3, 4) for layer in range(15, 30)]
    suite.observe_many(events)
    r = Report(suite.findings + suite.finish())
    # THEN one error names the first layer; the other 29 are its cascade; the symptom comes after it
    assert [f.rule for f in r.findings] == ["nonfinite", "usage-mismatch"]
    text = render(r, "text")
    assert "layer 15 of sequence 3: 3 non-finite attention values (max_logit=5.237, entropy=1, sink=0.5)" in text
    assert ("        and 29 more from the same cause: attention/nonfinite x29, 1 more sequence(s), layers 15-29, "
            "step 2") in text.splitlines()
    sarif = json.loads(render(r, "sarif"))["runs"][0]["results"][0]
    assert sarif["message"]["text"].endswith("(and 29 more from the same cause: attention/nonfinite x29, "
                                             "1 more sequence(s), layers 15-29, step 2)")
    assert r.counts() == {"error": 2, "warning": 0, "info": 0}
