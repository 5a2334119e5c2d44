"""What ``kvdoctor check`` prints: text for people, JSON for scripts, JUnit and SARIF for CI.

All four render one ``Report``. The JSON shape is a contract (docs/checks.md):
``{"findings": [...], "summary": {...}}``, every finding with ``check``, ``rule``,
``severity``, ``message``, ``seq``, ``block``, ``layer``, ``step``, ``trace`` (null where
they do not apply) and its evidence. A baseline file lists findings accepted as known, by their
timing-free ``Finding.key``, so CI fails only on new ones.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import msgspec

from . import __version__
from .errors import EXIT_FINDINGS, EXIT_OK, UsageError
from .findings import SEVERITIES, Finding, severity_rank, split_frame

__all__ = [
    "Report", "FORMATS", "render", "summary_line", "stack_lines", "load_baseline", "write_baseline", "apply_baseline",
]

FORMATS = ("text", "json", "junit", "sarif")
_BASELINE_FORMAT = "kvdoctor-baseline"
_SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


@dataclass
class Report:
    findings: list[Finding]
    fail_on: str = "error"
    source: str | None = None  # trace path or workload command, for people and SARIF
    trace_path: str | None = None  # the trace file the findings' event indexes point into
    num_events: int = 0
    truncated: bool = False
    suppressed: int = 0  # over a rule's cap
    baselined: int = 0  # accepted by the baseline
    notes: list[str] = field(default_factory=list)  # one-line remarks (truncation, workload status)

    def __post_init__(self) -> None:
        from .checks.causes import is_symptom

        # Root causes first: by severity, then what names a block or sequence before a count that is off.
        order = {s: i for i, s in enumerate(SEVERITIES)}
        self.findings = sorted(self.findings, key=lambda f: (order[f.severity], is_symptom(f),
                                                             f.step if f.step is not None else -1))

    def counts(self) -> dict[str, int]:
        c = Counter(f.severity for f in self.findings)
        return {s: c.get(s, 0) for s in SEVERITIES}

    def failing(self) -> list[Finding]:
        bar = severity_rank(self.fail_on)
        return [f for f in self.findings if severity_rank(f.severity) >= bar]

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.failing() else EXIT_OK

    def summary(self) -> dict[str, Any]:
        c = self.counts()
        return {
            "errors": c["error"], "warnings": c["warning"], "info": c["info"],
            "fail_on": self.fail_on, "failed": bool(self.failing()), "exit_code": self.exit_code,
            "events": self.num_events, "truncated": self.truncated, "suppressed": self.suppressed,
            "baselined": self.baselined, "source": self.source, "notes": list(self.notes),
        }


def summary_line(report: Report) -> str:
    c = report.counts()
    return f"KVDOCTOR SUMMARY: {c['error']} errors, {c['warning']} warnings, {c['info']} info"


def render(report: Report, fmt: str) -> str:
    if fmt == "text":
        return _text(report)
    if fmt == "json":
        return _json(report)
    if fmt == "junit":
        return _junit(report)
    if fmt == "sarif":
        return _sarif(report)
    raise UsageError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")


def finding_dict(f: Finding) -> dict[str, Any]:
    return msgspec.to_builtins(f)


# ---- text ------------------------------------------------------------------------------


def _what(f: Finding) -> str:
    """What a finding is about, without its step: the same in every run of a workload."""
    parts = [f"seq {f.seq!r}" if f.seq is not None else None,
             f"block {f.block}" if f.block is not None else None,
             f"layer {f.layer}" if f.layer is not None else None,
             f"trace {f.trace}" if f.trace is not None else None]
    return "  ".join(p for p in parts if p)


def _where(f: Finding) -> str:
    return "  ".join(p for p in (f"step {f.step}" if f.step is not None else "", _what(f)) if p)


_STACK_LABEL = {"alloc": "allocated", "seq_start": "sequence started", "seq_end": "sequence ended"}


def _more(f: Finding) -> list[str]:
    """What a finding's message line leaves out: its cascade, then its stacks."""
    from .checks.causes import cascade_line

    cascade = cascade_line(f)
    return ([cascade] if cascade else []) + stack_lines(f)


def _message(f: Finding) -> str:
    """The message with its cascade, for formats with one message per finding (SARIF, JUnit)."""
    from .checks.causes import cascade_line

    cascade = cascade_line(f)
    return f"{f.message} ({cascade})" if cascade else f.message


def stack_lines(f: Finding) -> list[str]:
    """One line per recorded stack: ``allocated at app.py:12 in main <- app.py:30 in <module>``."""
    out = []
    for kind, frames in f.stacks.items():
        if frames:
            calls = " <- ".join(f"{path}:{line} in {fn}" if fn else f"{path}:{line}"
                                for path, line, fn in map(split_frame, frames))
            out.append(f"{_STACK_LABEL.get(kind, kind)} at {calls}")
    return out


def _story(history: list[dict]) -> str:
    """A block's history on one line: alloc@3(device) -> write@3 v16 -> swap_out@7 device->host ..."""
    out = []
    for e in history:
        kind, step = e.get("kind"), e.get("step")
        if kind == "alloc":
            out.append(f"alloc@{step}({e.get('tier')}, seq {e.get('seq')!r})")
        elif kind == "write":
            out.append(f"write@{step} pos {e.get('pos')}+{e.get('n')} v{e.get('version')}")
        elif kind in ("swap_out", "swap_in"):
            out.append(f"{kind}@{step} {e.get('src')}->{e.get('dst')} v{e.get('version')}")
        elif kind in ("share", "release", "seq_end"):
            out.append(f"{kind}@{step}(seq {e.get('seq')!r})")
        else:
            out.append(f"{kind}@{step}")
    return " -> ".join(out)


def _text(report: Report) -> str:
    lines = []
    head = f"kvdoctor check: {report.source or 'events'}: {report.num_events} events"
    lines.append(head + (" (last line cut short)" if report.truncated else ""))
    for note in report.notes:
        lines.append(f"note: {note}")
    for f in report.findings:
        lines.append("")
        lines.append(f"{f.severity.upper():7} {f.check}/{f.rule}  {_where(f)}".rstrip())
        lines.append(f"        {f.message}")
        lines += [f"        {line}" for line in _more(f)]
        history = f.evidence.get("history")
        if history:
            lines.append(f"        history: {_story(history)}")
    if report.suppressed:
        lines.append("")
        lines.append(f"{report.suppressed} further findings over the per-rule cap were counted but not listed")
    if report.baselined:
        lines.append(f"{report.baselined} findings accepted by the baseline were not listed")
    lines.append("")
    lines.append(summary_line(report))
    return "\n".join(lines) + "\n"


# ---- json ------------------------------------------------------------------------------


def _json(report: Report) -> str:
    doc = {"findings": [finding_dict(f) for f in report.findings], "summary": report.summary()}
    return msgspec.json.encode(doc).decode() + "\n"


# ---- junit -----------------------------------------------------------------------------


def _junit(report: Report) -> str:
    """One test case per finding (failed at or above ``fail_on``), and one passing case per
    check with nothing to say, so CI dashboards show what was checked."""
    from .checks import ALL_CHECKS

    failing = {id(f) for f in report.failing()}
    suite = ET.Element("testsuite", name="kvdoctor", tests="0", failures="0", errors="0", skipped="0")
    num_tests = num_failures = 0
    reported = {f.check for f in report.findings}
    for check in [c.name for c in ALL_CHECKS if c.name not in reported]:
        ET.SubElement(suite, "testcase", classname=f"kvdoctor.{check}", name=f"{check}: no findings")
        num_tests += 1
    names: Counter[str] = Counter()
    for f in report.findings:
        # Named without the step, so a test keeps its name (and its history in CI) from run to run.
        name = f"{f.rule} {_what(f)}".strip()
        names[name] += 1
        if names[name] > 1:
            name = f"{name} #{names[name]}"
        case = ET.SubElement(suite, "testcase", classname=f"kvdoctor.{f.check}", name=name)
        where = f.code_location
        if where is not None:  # the attributes pytest writes, which CI annotations read
            case.set("file", where[0])
            case.set("line", str(where[1]))
        num_tests += 1
        body = "\n".join([f.message, *_more(f), json.dumps(f.evidence, indent=2, default=str)])
        if id(f) in failing:
            num_failures += 1
            fail = ET.SubElement(case, "failure", message=_message(f), type=f.severity)
            fail.text = body
        else:
            out = ET.SubElement(case, "system-out")
            out.text = f"{f.severity}: {body}"
    suite.set("tests", str(num_tests))
    suite.set("failures", str(num_failures))
    root = ET.Element("testsuites", name="kvdoctor")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# ---- sarif -----------------------------------------------------------------------------


def _sarif(report: Report) -> str:
    """SARIF 2.1.0: a rule per check/rule id; each result points at the user's line behind it
    (where the producer recorded stacks) and relates the trace line of the event that completed it
    (line 1 is the header, so event i is line i + 2)."""
    from .checks import RULES

    rules = [{
        "id": rid, "name": rid.replace("/", "."),
        "shortDescription": {"text": rule.summary},
        "defaultConfiguration": {"level": _SARIF_LEVEL[rule.severity]},
    } for rid, rule in RULES.items()]
    index = {rid: i for i, rid in enumerate(RULES)}
    results = []
    seen: Counter[str] = Counter()
    for f in report.findings:
        rid = f"{f.check}/{f.rule}"
        seen[f.key] += 1
        result: dict[str, Any] = {
            "ruleId": rid, "level": _SARIF_LEVEL[f.severity], "message": {"text": _message(f)},
            "properties": {"seq": f.seq, "block": f.block, "layer": f.layer, "step": f.step,
                           "trace": f.trace, "stacks": f.stacks, "evidence": f.evidence},
            # the n-th finding of one key is its own alert: code scanning merges equal fingerprints
            "partialFingerprints": {"kvdoctor/v2": f"{f.key}:{seen[f.key]}"},
        }
        if rid in index:
            result["ruleIndex"] = index[rid]
        related = [{"physicalLocation": _code_location(frames[0]),
                    "message": {"text": f"{_STACK_LABEL.get(kind, kind)} here"}}
                   for kind, frames in f.stacks.items() if frames]
        trace = f.trace or report.trace_path
        if trace:
            location: dict[str, Any] = {"artifactLocation": {"uri": _uri(trace)}}
            event_index = f.evidence.get("event_index")
            if isinstance(event_index, int):
                location["region"] = {"startLine": event_index + 2}
            related.append({"physicalLocation": location,
                            "message": {"text": "the trace event that completed the finding"}})
        if related:
            # The user's line comes first where the producer recorded it; else the trace's line.
            result["locations"] = [{"physicalLocation": related[0]["physicalLocation"]}]
            result["relatedLocations"] = [dict(r, id=i) for i, r in enumerate(related)]
        results.append(result)
    doc = {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "kvdoctor", "version": __version__,
                                "informationUri": "https://github.com/kvdoctor/kvdoctor", "rules": rules}},
            "results": results,
        }],
    }
    return msgspec.json.encode(doc).decode() + "\n"


def _uri(path: str) -> str:
    """A path as SARIF wants it: relative to the working directory (the repository root in CI) where
    it lies under it, so code scanning can open it; else an absolute ``file://`` URI."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return p.as_uri()


def _code_location(frame: str) -> dict[str, Any]:
    path, line, _ = split_frame(frame)
    location: dict[str, Any] = {"artifactLocation": {"uri": _uri(path)}}
    if line > 0:
        location["region"] = {"startLine": line}
    return location


# ---- baselines -------------------------------------------------------------------------


def load_baseline(path: str | Path) -> Counter[str]:
    """The finding keys a baseline accepts, with how many of each."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"baseline {p} does not exist (create it with --write-baseline)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"baseline {p} is not readable JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != _BASELINE_FORMAT or not isinstance(doc.get("findings"), list):
        raise UsageError(f"baseline {p} is not a kvdoctor baseline (write one with --write-baseline)")
    keys: Counter[str] = Counter()
    for entry in doc["findings"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise UsageError(f"baseline {p}: every finding needs a string 'key'")
        keys[entry["key"]] += 1
    return keys


def write_baseline(path: str | Path, findings: Iterable[Finding]) -> int:
    """Accept ``findings`` as known from now on; returns how many were written."""
    entries = [{"key": f.key, "check": f.check, "rule": f.rule, "severity": f.severity, "message": f.message}
               for f in findings]
    doc = {"format": _BASELINE_FORMAT, "version": 1, "findings": entries}
    try:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write baseline {path}: {exc.strerror}") from None
    return len(entries)


def apply_baseline(findings: Iterable[Finding], accepted: Counter[str]) -> tuple[list[Finding], int]:
    """Findings the baseline does not accept, and how many it did."""
    left = Counter(accepted)
    kept, dropped = [], 0
    for f in findings:
        if left[f.key] > 0:
            left[f.key] -= 1
            dropped += 1
        else:
            kept.append(f)
    return kept, dropped
