"""The suite: policy (disabled rules, severities, caps) and checks used on their own."""

from __future__ import annotations

import subprocess
import sys

from kvdoctor.checks import LeakCheck, make_suite
from tracebuilder import TraceBuilder, rules


def leaky_trace(num_seqs: int) -> TraceBuilder:
    trace = TraceBuilder()
    for i in range(num_seqs):
        (b,) = trace.sequence_with_blocks(i, 1, first_block=i)
        trace.swap_out(b, "host")
        trace.end(i)
        trace.end_step()
    return trace


def test_disabled_rules_and_checks_report_nothing():
    trace = leaky_trace(2)
    assert trace.run(disabled=["leak/unreachable-swapped"]) == []
    assert trace.run(disabled=["leak"]) == []
    assert len(trace.run(disabled=["stale"])) == 2


def test_severity_override():
    findings = leaky_trace(1).run(severity={"leak/unreachable-swapped": "warning"})
    assert [f.severity for f in findings] == ["warning"]


def test_each_rule_is_capped_and_the_rest_counted():
    trace = leaky_trace(30)
    suite = make_suite(max_per_rule=5)
    for ev in trace.events:
        suite.observe(ev)
    suite.finish()
    assert len(suite.findings) == 5
    assert suite.suppressed == 25


def test_a_check_used_alone_follows_the_check_protocol():
    trace = leaky_trace(1)
    check = LeakCheck()
    found = [f for ev in trace.events for f in check.observe(ev)] + list(check.finish())
    assert rules(found) == ["leak/unreachable-swapped"]


def test_checks_import_neither_torch_nor_the_engine():
    code = "import sys, kvdoctor.checks; print(sorted(m for m in sys.modules if m.startswith(('torch', 'kvdoctor.engine'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
