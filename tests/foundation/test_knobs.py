"""The knobs: every KVDOCTOR_* variable declared once, validated with a message naming it, documented from the module."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor import knobs

ROOT = Path(__file__).resolve().parents[2]
_SOURCES = ("engine", "checks", "kvdoctor", "tests", "benchmarks", "examples", "docs")


def test_docs_table_is_generated_from_the_module():
    # GIVEN docs/knobs.md THEN it is exactly what the module writes (regenerate: python -m kvdoctor.knobs)
    assert (ROOT / "docs" / "knobs.md").read_text() == knobs.markdown()


def test_every_kvdoctor_variable_named_anywhere_is_a_declared_knob():
    # GIVEN every KVDOCTOR_* name in the code and docs THEN each is declared in kvdoctor.knobs
    declared = {k.name for k in knobs.KNOBS}
    named = set()
    for folder in _SOURCES:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".toml") and path.is_file():  # C include guards are no variables
                named |= set(re.findall(r"KVDOCTOR_[A-Z_]*[A-Z]", path.read_text(errors="replace")))
    named |= set(re.findall(r"KVDOCTOR_[A-Z_]*[A-Z]", (ROOT / "README.md").read_text()))
    assert named <= declared, f"undeclared: {sorted(named - declared)}"


def test_unset_or_blank_is_the_default():
    assert knobs.get(knobs.VERIFY, {}) == "sample"
    assert knobs.get(knobs.VERIFY, {"KVDOCTOR_VERIFY": "  "}) == "sample"
    assert knobs.get(knobs.MATVEC, {}) is True and knobs.get(knobs.PROBES, {}) is None
    assert knobs.get(knobs.PROBES_INTERVAL, {}) == 0.5


@pytest.mark.parametrize("knob,raw,value", [
    (knobs.HUGEPAGES, "0", False), (knobs.HUGEPAGES, "off", False), (knobs.PROBES, "Yes", True),
    (knobs.PROBES_INTERVAL, "0.25", 0.25), (knobs.VERIFY, "full", "full"), (knobs.TRACE, " a.kvtrace ", "a.kvtrace"),
    (knobs.FUZZ_EXAMPLES, "2000", 2000),
])
def test_a_value_is_parsed_to_its_type(knob, raw, value):
    assert knobs.get(knob, {knob.name: raw}) == value


@pytest.mark.parametrize("knob,raw", [
    (knobs.PROBES, "maybe"), (knobs.PROBES_HEAP, "2"), (knobs.PROBES_INTERVAL, "0"), (knobs.PROBES_INTERVAL, "fast"),
    (knobs.VERIFY, "always"), (knobs.MATVEC, "nope"), (knobs.FUZZ_EXAMPLES, "-3"),
])
def test_a_bad_value_is_a_value_error_naming_the_variable_and_what_it_accepts(knob, raw):
    with pytest.raises(ValueError, match=rf"^{knob.name}='{re.escape(raw)}': must be {re.escape(knob.accepted)}$"):
        knobs.get(knob, {knob.name: raw})


def test_a_change_to_the_environment_is_seen_by_the_next_read(monkeypatch):
    # GIVEN a knob read once WHEN the environment changes (a test, a benchmark's A/B) THEN the next read sees it
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "0")
    assert knobs.get(knobs.DECODE_LAYER) is False
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "1")
    assert knobs.get(knobs.DECODE_LAYER) is True
    monkeypatch.delenv("KVDOCTOR_DECODE_LAYER")
    assert knobs.get(knobs.DECODE_LAYER) is True


def test_the_module_imports_only_the_standard_library():
    # every layer imports it, so importing it must pull in nothing of kvdoctor's but the package itself
    code = ("import sys; import kvdoctor.knobs; "
            "extra = [m for m in sys.modules if m.startswith('kvdoctor') and m not in ('kvdoctor', 'kvdoctor.knobs')]; "
            "assert not extra and 'torch' not in sys.modules, extra")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


_ENV_READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[|\bin os\.environ\b")


def test_nothing_but_the_knobs_module_reads_the_environment():
    # GIVEN the package's modules (engine/, checks/, kvdoctor/) THEN none reads a variable from os.environ itself;
    # copying the environment for a child process or setting a variable stays allowed
    readers = [str(path.relative_to(ROOT)) for folder in ("engine", "checks", "kvdoctor")
               for path in (ROOT / folder).rglob("*.py") if _ENV_READ.search(path.read_text())]
    assert set(readers) <= {"kvdoctor/knobs.py"}
