"""Every environment variable kvdoctor reads, declared once: its name, default, type, meaning and accepted values.

Nothing else reads ``os.environ`` for a setting: a module asks ``knobs.get(knobs.TRACE)``. A value is parsed
and validated once and cached; the process's environment stays the one source, so a change to it (a test's
``monkeypatch.setenv``, a benchmark's A/B, a parent building a child's environment) is seen by the next
``get`` and parsed then, once. ``get(knob, environ)`` reads a mapping of your own instead (a child's
environment before it starts). A bad value raises ``KnobError`` (a ``ValueError``) naming the variable and
what it accepts; the CLI shows it as one line, exit code 2.

This module imports only the standard library, so every layer may import it: the engine, the checks and the
integrations as well as the app (the layering test, tests/foundation/test_packaging.py, allows it to all).
docs/knobs.md is generated from it: ``python -m kvdoctor.knobs > docs/knobs.md`` (a test keeps them equal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = [
    "Knob", "KnobError", "KNOBS", "get", "markdown",
    "TRACE", "ATTACH_DIR", "FAULT", "VERIFY", "VERIFY_MODES", "PROBES", "PROBES_INTERVAL", "PROBES_HEAP",
    "MATVEC", "DECODE_LAYER", "HUGEPAGES", "THREADS", "CC", "XDG_CACHE_HOME", "HYPOTHESIS", "FUZZ_EXAMPLES", "FUZZ_REPORT",
    "TP_SHELL", "VLLM_RANK_DIGESTS",
]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class KnobError(ValueError):
    """An environment variable set to a value its knob does not accept."""


@dataclass(frozen=True)
class Knob:
    """One environment variable; unset or empty means ``default``."""

    name: str
    kind: str  # flag | path | command | name | choice | seconds | count | word: what ``parse`` reads, for the docs
    default: Any
    meaning: str
    accepted: str  # what a value may be, in the words the docs and the error use
    parse: Callable[[str], Any]  # raises ValueError on a value it does not accept
    config_field: str | None = None  # the config field this variable is the default of, where there is one
    scope: str = "kvdoctor"  # kvdoctor: its own variables; standard: other programs' that it honours; tests


def _flag(raw: str) -> bool:
    word = raw.lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(raw)
    return word in _TRUE


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw

    return parse


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        value = kind(raw)
        if not value > 0:
            raise ValueError(raw)
        return value

    return parse


def _flag_knob(name: str, default: bool | None, meaning: str, **extra: Any) -> Knob:
    return Knob(name, "flag", default, meaning, "1 or 0 (also true/false, yes/no, on/off)", _flag, **extra)


def _text_knob(name: str, kind: str, meaning: str, accepted: str, **extra: Any) -> Knob:
    return Knob(name, kind, None, meaning, accepted, str, **extra)


VERIFY_MODES = ("off", "sample", "full")  # content digests (engine.kv.digest); EngineConfig.verify takes the same

TRACE = _text_knob(
    "KVDOCTOR_TRACE", "path", "the trace file every producer in the process writes: each engine cache (a second "
    "cache in the process writes beside it, numbered), the transformers observer, the vLLM plugin. Unset: no trace",
    "a file path; a name ending .kvtrace.msgpack picks the binary encoding")
ATTACH_DIR = _text_knob(
    "KVDOCTOR_ATTACH_DIR", "path", "the folder where `kvdoctor watch|check --pid` leaves its request to a running "
    "process and the process answers it; both must see the same value. Unset: kvdoctor-attach-<uid> in the temp folder",
    "a folder path (created when missing)")
FAULT = _text_knob(
    "KVDOCTOR_FAULT", "name", "the engine's deliberate fault, switched on in every cache the process builds",
    "a fault name of `kvdoctor.engine.faults.FAULTS` (listed in docs/checks.md and `kvdoctor run --help`)",
    config_field="EngineConfig.fault")
VERIFY = Knob(
    "KVDOCTOR_VERIFY", "choice", "sample", "how the engine verifies the content digests of the blocks it reads: "
    "every read (full), a bounded sweep (sample: every block a sequence reads within 32 of its reads, "
    "a first read at once) or none (off); swaps are always verified",
    f"one of {', '.join(VERIFY_MODES)}", _choice(*VERIFY_MODES), config_field="EngineConfig.verify")
PROBES = _flag_knob(
    "KVDOCTOR_PROBES", None, "memory probes (mem events) in a workload that builds kvdoctor's engine with a trace. "
    "Unset: on for `kvdoctor run --trace`, off elsewhere")
PROBES_INTERVAL = Knob(
    "KVDOCTOR_PROBES_INTERVAL", "seconds", 0.5, "seconds between two memory readings of the probes",
    "a number of seconds > 0", _positive(float))
PROBES_HEAP = _flag_knob(
    "KVDOCTOR_PROBES_HEAP", False, "the probes also start tracemalloc: the Python heap and what allocated it (costly)")
MATVEC = _flag_knob(
    "KVDOCTOR_MATVEC", True, "the compiled matrix-vector kernel for the model's projections; 0: torch's (an A/B)")
DECODE_LAYER = _flag_knob(
    "KVDOCTOR_DECODE_LAYER", True, "the compiled decode step for a plain Llama model on CPU; 0: the torch path")
HUGEPAGES = _flag_knob(
    "KVDOCTOR_HUGEPAGES", True, "the model's weights copied onto 2 MB pages on Linux; 0: they stay where torch put them")
THREADS = Knob(
    "KVDOCTOR_THREADS", "choice", "adaptive", "the engine's thread team: adaptive sizes it to the CPUs other processes "
    "leave (engine.model.threads); fixed keeps the size the process started with", "adaptive, fixed",
    _choice("adaptive", "fixed"))
CC = Knob("CC", "command", "cc", "the C compiler that builds the native kernels on first use", "a compiler command",
          str, scope="standard")
XDG_CACHE_HOME = _text_knob(
    "XDG_CACHE_HOME", "path", "where kvdoctor/ keeps the converted embedded model, the compiled kernels and "
    "calibrations. Unset: ~/.cache", "a directory", scope="standard")
HYPOTHESIS = Knob(
    "KVDOCTOR_HYPOTHESIS", "word", "explore", "the test suite's hypothesis profile: ci draws the same inputs every "
    "run, so a CI failure reproduces; explore searches afresh", "one of ci, explore", _choice("ci", "explore"),
    scope="tests")
FUZZ_EXAMPLES = Knob(
    "KVDOCTOR_FUZZ_EXAMPLES", "count", None, "inputs per fuzz test (unset: the suite's CI budget)",
    "a whole number > 0", _positive(int), scope="tests")
FUZZ_REPORT = _text_knob(
    "KVDOCTOR_FUZZ_REPORT", "path", "a file each fuzz test appends its tally to (one JSON line)", "a file path",
    scope="tests")
VLLM_RANK_DIGESTS = _flag_knob(
    "KVDOCTOR_VLLM_RANK_DIGESTS", False, "the vLLM plugin's tensor- and pipeline-parallel ranks digest the K/V each "
    "forward pass writes, so a KV connector saving other bytes than a rank wrote is found "
    "(integrity/read-mismatch); costs torch work per layer and step (docs/vllm.md)")
TP_SHELL = _text_knob(
    "KVDOCTOR_TP_SHELL", "path", "a Perfetto trace_processor_shell binary: the Perfetto export is checked with it",
    "a file path", scope="tests")

KNOBS: tuple[Knob, ...] = (TRACE, ATTACH_DIR, FAULT, VERIFY, PROBES, PROBES_INTERVAL, PROBES_HEAP, MATVEC,
                           DECODE_LAYER, HUGEPAGES, VLLM_RANK_DIGESTS, THREADS, CC, XDG_CACHE_HOME, HYPOTHESIS,
                           FUZZ_EXAMPLES, FUZZ_REPORT,
                           TP_SHELL)

_parsed: dict[str, tuple[str, Any]] = {}  # name -> (the raw value last parsed, its value)


def get(knob: Knob, environ: Mapping[str, str] | None = None) -> Any:
    """``knob``'s value in the process's environment (or in ``environ``); unset or blank: its default."""
    raw = (os.environ if environ is None else environ).get(knob.name, "").strip()
    if not raw:
        return knob.default
    seen = _parsed.get(knob.name)
    if seen is not None and seen[0] == raw:
        return seen[1]
    try:
        value = knob.parse(raw)
    except ValueError:
        raise KnobError(f"{knob.name}={raw!r}: must be {knob.accepted}") from None
    _parsed[knob.name] = (raw, value)
    return value


def markdown() -> str:
    """docs/knobs.md: every knob as a table row, kvdoctor's own first, then the standard ones, then the tests'."""
    lines = [
        "# Environment variables",
        "",
        "Every environment variable kvdoctor reads, generated from `kvdoctor/knobs.py` "
        "(`python -m kvdoctor.knobs > docs/knobs.md`). Unset or empty means the default. "
        "A value a variable does not accept is an error naming the variable and what it accepts "
        "(exit code 2 from the command line). Where a variable is the default of an `EngineConfig` field, "
        "the field, when set, wins.",
        "",
        "Settings kept in files are declared where they are read: the checks' `[tool.kvdoctor]` in "
        "`kvdoctor/config.py` ([checks.md](checks.md)), the engine's `EngineConfig` fields with their ranges in "
        "`engine/config.py`.",
    ]
    for scope, title in (("kvdoctor", "kvdoctor's own"), ("standard", "Standard variables kvdoctor honours"),
                         ("tests", "Read by the test suite")):
        lines += ["", f"## {title}", "", "| variable | type | default | accepted | meaning |", "|---|---|---|---|---|"]
        for k in (k for k in KNOBS if k.scope == scope):
            default = "unset" if k.default is None else f"`{_shown(k.default)}`"
            meaning = k.meaning + (f" (the default of `{k.config_field}`)" if k.config_field else "")
            lines.append(f"| `{k.name}` | {k.kind} | {default} | {k.accepted} | {meaning} |")
    return "\n".join(lines) + "\n"


def _shown(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


if __name__ == "__main__":
    print(markdown(), end="")
