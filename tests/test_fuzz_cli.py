"""Fuzzing kvdoctor's other inputs: config files, baselines and every command-line option.

Every input keeps the rule in tests/fuzzing.py (exit 0-3, one stderr line at most, no traceback, no
hang). Commands run in this process, in a scratch directory (options that write files write there):

* check (always with --trace, so a second source is a usage error before anything starts), info,
  export and attention-profile run to the end on every input;
* watch, replay (a TUI), run, profile (a model, a workload) and doctor (torch, a py-spy test: seconds
  each, tests/test_doctor.py covers its inputs) have their options parsed only, and
  --follow (it waits for a writer by design) and valid --metrics-port values (a server that outlives
  the input) are left out of check's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import FUZZ, Tally, run_kvdoctor
from kvdoctor.checks import RULES
from kvdoctor.cli import build_parser
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.synthetic import SyntheticWorkload

RUN_TO_THE_END = ("check", "info", "export", "attention-profile")
PARSE_ONLY = ("watch", "replay", "run", "profile", "doctor")
LEFT_OUT = {"check": {"--demo", "--vllm-events", "--follow", "workload"}}

# Argument text as a shell could pass it (no NUL byte: argv cannot hold one).
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=24)
NUMBERS = (st.integers(-(2**70), 2**70) | st.floats() | st.sampled_from([0, -1, 1, 65536, 2**31])).map(str)


class Scratch(dict):
    """Files the fuzzed options point at (short repr: hypothesis prints it with a failing example)."""

    def __repr__(self) -> str:
        return "Scratch()"

    def restore(self) -> None:
        """Put back the input files: an output option may have been pointed at one of them."""
        for path, data in self["pristine"].items():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            path.write_bytes(data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A scratch directory (the working directory during the module) holding every kind of path an
    option may get: traces clean, leaky and corrupt, configs, a baseline, a directory, nothing."""
    root = tmp_path_factory.mktemp("fuzz-cli")
    old = os.getcwd()
    os.chdir(root)
    for name, fault in (("clean.kvtrace", None), ("leak.kvtrace", "leak-swapped")):
        work = SyntheticWorkload(num_steps=30, fault=fault, fault_step=5)
        with TraceWriter(root / name, work.header()) as writer:
            writer.write_many(list(work.events()))
    (root / "corrupt.kvtrace").write_bytes(b'{"kind": "header"\n\x00\xff garbage\n')
    (root / "empty.kvtrace").write_bytes(b"")
    (root / "good.toml").write_text('fail_on = "warning"\ndisable = ["attention"]\n[leak]\ngrace_steps = 1\n')
    (root / "bad.toml").write_text("fail_on = [\n")
    (root / "a-dir").mkdir()
    assert run_kvdoctor(["check", "--trace", "leak.kvtrace", "--write-baseline", "baseline.json"]).code == 0
    assert run_kvdoctor(["attention-profile", "clean.kvtrace", "-o", "profile.json"]).code == 0
    pristine = {f: f.read_bytes() for f in root.iterdir() if f.is_file()}
    paths = ["clean.kvtrace", "leak.kvtrace", "corrupt.kvtrace", "empty.kvtrace", "good.toml", "bad.toml",
             "baseline.json", "profile.json", "a-dir", "missing.kvtrace", "no-dir/out.json", "out.json", ""]
    yield Scratch(root=root, paths=paths, baseline=json.loads((root / "baseline.json").read_text()), pristine=pristine)
    os.chdir(old)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _value(action: argparse.Action, paths: list[str]) -> st.SearchStrategy[str]:
    """Text for one option or positional: its own kinds of value, and anything else."""
    if action.choices:
        return st.sampled_from([str(c) for c in action.choices]) | TEXT
    if action.type in (int, float) or getattr(action.type, "__name__", "") == "parse":
        return NUMBERS | TEXT
    return st.sampled_from(paths) | TEXT


@st.composite
def argv_for(draw, command: str, paths: list[str]) -> list[str]:
    """A command line for ``command``: a random subset of its options, in random order, with values."""
    parser = _subparsers()[command]
    left_out = LEFT_OUT.get(command, set())
    argv: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or left_out & {action.dest, *action.option_strings}:
            continue
        required = not action.option_strings and action.nargs != argparse.REMAINDER
        if not (required or draw(st.integers(0, 3)) == 0):  # each option in about one line of four
            continue
        words = [draw(st.sampled_from(action.option_strings))] if action.option_strings else []
        if action.nargs != 0:
            count = draw(st.integers(1, 2)) if action.nargs in ("+", "*") else 1
            words += [draw(_value(action, paths)) for _ in range(count)]
        argv.append(words)
    argv = [w for words in draw(st.permutations(argv)) for w in words]
    if command == "check":  # one source that starts nothing; a --metrics-port only where it is refused
        argv = ["--trace", draw(st.sampled_from(paths))] + _no_valid_port(argv, draw)
    return [command, *argv]


def _no_valid_port(argv: list[str], draw) -> list[str]:
    """``argv`` with any --metrics-port value replaced by one the command refuses (0, 65536 or text)."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == "--metrics-port":
            out[i + 1] = draw(st.sampled_from(["0", "65536", "-5", "port", ""]))
    return out


OPTIONS_TALLY, PARSE_TALLY = Tally("command-line options (run)"), Tally("command-line options (parsed only)")
CONFIG_TALLY, BASELINE_TALLY = Tally("config files"), Tally("baselines")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for tally in (OPTIONS_TALLY, PARSE_TALLY, CONFIG_TALLY, BASELINE_TALLY):
        tally.write()


@FUZZ
@given(data=st.data())
def test_every_option_of_the_commands_that_run_here_keeps_the_rule(scratch, data):
    scratch.restore()
    command = data.draw(st.sampled_from(RUN_TO_THE_END))
    OPTIONS_TALLY.judge(run_kvdoctor(data.draw(argv_for(command, scratch["paths"]))))


@FUZZ
@given(data=st.data())
def test_every_option_of_the_other_commands_parses_or_is_one_line(scratch, data):
    argv = data.draw(argv_for(data.draw(st.sampled_from(PARSE_ONLY)), scratch["paths"]))
    PARSE_TALLY.judge(_parse_only(argv))


def _parse_only(argv: list[str]):
    """Parse ``argv`` as ``kvdoctor`` would, without running the command."""
    import fuzzing

    real = fuzzing.main
    fuzzing.main = lambda a: build_parser().parse_args(a) and 0
    try:
        return run_kvdoctor(argv)
    finally:
        fuzzing.main = real


# ---- config files ------------------------------------------------------------------------------

SETTINGS = ["fail_on", "disable", "severity", "max_findings_per_rule", "history", "baseline", "attention_profile",
            "leak", "attention"]
TOML_SCALARS = (st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
                | st.sampled_from(["error", "warning", "info", "auto", "none", *RULES, "leak", "attention"]) | TEXT)
TOML_VALUES = st.recursive(TOML_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from([*RULES, "grace_steps", "margin", "persist"]) | TEXT,
                                             inner, max_size=3), max_leaves=6)


def _toml(value) -> str:
    """``value`` as a TOML inline value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(value, repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {_toml(v)}" for k, v in value.items()) + "}"


@st.composite
def config_text(draw) -> bytes:
    """A settings file: known and unknown keys with values of any type, maybe under [tool.kvdoctor], maybe cut."""
    table = draw(st.dictionaries(st.sampled_from(SETTINGS) | TEXT, TOML_VALUES, max_size=5))
    text = "\n".join(f"{json.dumps(k, ensure_ascii=False)} = {_toml(v)}" for k, v in table.items()) + "\n"
    if draw(st.booleans()):
        text = "[tool.kvdoctor]\n" + text
    data = text.encode()
    if draw(st.integers(0, 4)) == 0:  # a byte-level accident on top
        pos = draw(st.integers(0, len(data)))
        data = data[:pos] + draw(st.binary(max_size=8)) + data[pos + draw(st.integers(0, 8)):]
    return data


@FUZZ
@given(text=config_text())
def test_any_config_file_is_read_or_refused_in_one_line(scratch, text):
    scratch.restore()
    (scratch["root"] / "fuzzed.toml").write_bytes(text)
    outcome = run_kvdoctor(["check", "--trace", "leak.kvtrace", "--config", "fuzzed.toml", "--format", "json"])
    CONFIG_TALLY.judge(outcome, _whole_trace_judged(outcome.code) or _passed_unlowered(outcome.code, text))


def _whole_trace_judged(code: int | None) -> str | None:
    """The trace is whole: whatever the setting, it is judged (0, 1) or the setting refused (2)."""
    return "exit 3 (unreadable trace) for a whole trace" if code == 3 else None


def _passed_unlowered(code: int | None, text: bytes) -> str | None:
    """The leaky trace passed (exit 0): only right when the config let it (disabled, lowered or baselined)."""
    if code != 0:
        return None
    lowered = any(word in text for word in (b"disable", b"severity", b"fail_on", b"baseline", b"leak",
                                            b"max_findings_per_rule"))
    return None if lowered else "a leaky trace passed under a config that changes nothing about leaks"


# ---- baselines -----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                           max_leaves=8)


@st.composite
def baseline_text(draw, valid: dict) -> bytes:
    """A baseline: the real one with one part replaced by any JSON value, any JSON, or raw bytes."""
    kind = draw(st.sampled_from(["part", "entry", "json", "bytes"]))
    doc = json.loads(json.dumps(valid))
    if kind == "part":
        doc[draw(st.sampled_from([*doc, "extra"]))] = draw(JSON_VALUES)
    elif kind == "entry" and doc["findings"]:
        entry = doc["findings"][draw(st.integers(0, len(doc["findings"]) - 1))]
        entry[draw(st.sampled_from([*entry, "extra"]))] = draw(JSON_VALUES)
    elif kind == "json":
        doc = draw(JSON_VALUES)
    else:
        return draw(st.binary(max_size=200))
    return json.dumps(doc).encode()


@FUZZ
@given(data=st.data())
def test_any_baseline_is_applied_or_refused_in_one_line(scratch, data):
    scratch.restore()
    (scratch["root"] / "fuzzed.json").write_bytes(data.draw(baseline_text(scratch["baseline"])))
    outcome = run_kvdoctor(["check", "--trace", "leak.kvtrace", "--baseline", "fuzzed.json", "--format", "json"])
    BASELINE_TALLY.judge(outcome, _whole_trace_judged(outcome.code))
