"""The exit codes are one list: errors.EXIT_CODES, printed by --help and written in README and docs/cli.md."""

from __future__ import annotations

import re
from pathlib import Path

from kvdoctor.cli import build_parser, main
from kvdoctor.errors import EXIT_CODES, EXIT_ENGINE, EXIT_USAGE, EngineFailure, UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_docs_cli_lists_every_exit_code_as_the_module_says_it():
    rows = dict(re.findall(r"^\| (\d) \| (.+?) \|$", (ROOT / "docs" / "cli.md").read_text(), re.M))
    assert {int(code): meaning for code, meaning in rows.items()} == EXIT_CODES


def test_readme_names_every_exit_code():
    readme = " ".join((ROOT / "README.md").read_text().split())
    for code in EXIT_CODES:
        assert f"**{code}**" in readme, code
    assert "**4** the engine failed while running" in readme


def test_help_prints_every_exit_code():
    epilog = build_parser().epilog
    for code, meaning in EXIT_CODES.items():
        assert f"{code} {meaning}" in epilog


def test_an_engine_failure_has_its_own_code_apart_from_usage():
    assert EngineFailure.exit_code == EXIT_ENGINE != UsageError.exit_code == EXIT_USAGE


def test_a_bad_knob_value_is_one_usage_line_naming_the_variable(monkeypatch, capsys):
    # GIVEN KVDOCTOR_VERIFY set to a mode that does not exist, and a command that reads it (as the engine does)
    from kvdoctor import knobs
    from kvdoctor.commands import info

    monkeypatch.setenv("KVDOCTOR_VERIFY", "always")
    monkeypatch.setattr(info, "run", lambda args: knobs.get(knobs.VERIFY))
    # WHEN the command runs
    code = main(["info", "any.kvtrace"])
    # THEN it is a usage error: one line naming the variable and what it accepts
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.count("\n") == 1
    assert "KVDOCTOR_VERIFY='always': must be one of off, sample, full" in err


def test_version_prints_the_installed_version_and_exits_0():
    import subprocess
    import sys
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "kvdoctor.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"kvdoctor {version('kvdoctor')}"
