"""kvdoctor settings: ``[tool.kvdoctor]`` in ``pyproject.toml``, or a ``--config FILE.toml``.

    [tool.kvdoctor]
    fail_on = "warning"                         # error | warning | info
    disable = ["attention/sink-shift"]          # checks or check/rule ids
    severity = { "leak/usage-mismatch" = "warning" }
    max_findings_per_rule = 100
    history = 12                                # events of a block's history kept as evidence
    baseline = "kvdoctor-baseline.json"         # findings accepted as known

    [tool.kvdoctor.leak]
    grace_steps = 0

    attention_profile = "auto"                  # auto (shipped for the trace's model) | none | FILE.json

    [tool.kvdoctor.attention]
    margin = 0.5
    persist = 2

    [tool.kvdoctor.limits]                      # what a long run remembers of its past (kvdoctor.limits)
    freed_blocks = 4096
    ended_seqs = 65536

Everything is validated once, here; a bad value is a ``UsageError`` (exit code 2) that names
the file, the key and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checks import (
    ALL_CHECKS, RULES, AttentionProfile, AttentionSettings, CheckSuite, LeakSettings, make_suite, shipped_profile,
)
from .errors import UsageError
from .findings import SEVERITIES
from .limits import Limits

__all__ = ["Config", "load_config", "parse_config", "find_pyproject"]

_SECTIONS = {"leak": LeakSettings, "attention": AttentionSettings, "limits": Limits}
_CHECK_NAMES = {c.name for c in ALL_CHECKS}


@dataclass(frozen=True)
class Config:
    fail_on: str = "error"
    disable: tuple[str, ...] = ()
    severity: dict[str, str] = field(default_factory=dict)
    max_findings_per_rule: int = 100
    history: int = 12
    baseline: str | None = None
    # "auto": the profile kvdoctor ships for the trace's model, if any; "none": ranges learned from the trace
    # itself; else a profile file (``kvdoctor attention-profile``), relative to the config file's folder.
    attention_profile: str = "auto"
    leak: LeakSettings = field(default_factory=LeakSettings)
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    limits: Limits = field(default_factory=Limits)
    source: str | None = None  # the file it came from, for messages

    def make_suite(self, model: str | None = None) -> CheckSuite:
        """Every check under these settings; ``model`` (a trace header's) picks the shipped attention profile."""
        return make_suite(
            leak=self.leak, attention=self.attention, disabled=self.disable, severity=self.severity,  # type: ignore[arg-type]
            max_per_rule=self.max_findings_per_rule, history=self.history,
            freed_kept=self.limits.freed_blocks, ended_kept=self.limits.ended_seqs,
            attention_profile=self.attention_profile_for(model),
        )

    def attention_profile_for(self, model: str | None) -> AttentionProfile | None:
        """The attention profile to judge a trace of ``model`` against (None: learn from the trace)."""
        if self.attention_profile == "none":
            return None
        if self.attention_profile == "auto":
            return shipped_profile(model)
        return _load_profile(self.attention_profile, self.source)

    def with_overrides(self, *, fail_on: str | None = None, disable: list[str] | None = None,
                       attention_profile: str | None = None, source: str = "command line") -> "Config":
        """Settings given closer to the run (command line, a test's marker) win over the file."""
        changes: dict[str, Any] = {}
        if fail_on is not None:
            changes["fail_on"] = _severity("fail_on", fail_on, source)
        if attention_profile is not None:
            _load_profile(attention_profile, source)  # a bad file is a usage error now, not mid-run
            changes["attention_profile"] = attention_profile
        if disable:
            changes["disable"] = self.disable + tuple(_rule_ids("disable", disable, source))
        return dataclasses.replace(self, **changes) if changes else self


def find_pyproject(start: str | Path | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` at or above ``start`` (default: the working directory)."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_config(path: str | Path | None = None, *, start: str | Path | None = None) -> Config:
    """Settings from ``path`` (a kvdoctor TOML file, or a pyproject with ``[tool.kvdoctor]``),
    else from the nearest ``pyproject.toml``; defaults where neither says anything."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file {p} does not exist")
        data = _read_toml(p)
        tool = data.get("tool")
        if isinstance(tool, dict):  # a pyproject.toml: only its [tool.kvdoctor] is ours
            return parse_config(tool.get("kvdoctor", {}), f"{p} [tool.kvdoctor]")
        return parse_config(data, str(p))
    found = find_pyproject(start)
    if found is None:
        return Config()
    table = _read_toml(found).get("tool", {}).get("kvdoctor")
    if table is None:
        return Config()
    return parse_config(table, f"{found} [tool.kvdoctor]")


def parse_config(table: dict[str, Any], source: str = "config") -> Config:
    if not isinstance(table, dict):
        raise UsageError(f"{source}: must be a table of settings")
    values: dict[str, Any] = {"source": source}
    top = {f.name for f in dataclasses.fields(Config)} - {"source", *_SECTIONS}
    for key, value in table.items():
        if key in _SECTIONS:
            values[key] = _section(key, value, source)
        elif key == "fail_on":
            values[key] = _severity(key, value, source)
        elif key == "disable":
            if not isinstance(value, list):
                raise UsageError(f"{source}: disable must be a list of checks or check/rule ids, got {value!r}")
            values[key] = tuple(_rule_ids(key, value, source))
        elif key == "severity":
            if not isinstance(value, dict):
                raise UsageError(f"{source}: severity must be a table of \"check/rule\" = severity")
            values[key] = {rule: _severity(f"severity.{rule}", sev, source)
                           for rule in _rule_ids("severity", list(value), source, rules_only=True)
                           for sev in (value[rule],)}
        elif key in ("max_findings_per_rule", "history"):
            lo = 1 if key == "max_findings_per_rule" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= 1_000_000:
                raise UsageError(f"{source}: {key} must be an integer in [{lo}, 1000000], got {value!r}")
            values[key] = value
        elif key == "attention_profile":
            if not isinstance(value, str) or not value:
                raise UsageError(f"{source}: attention_profile must be \"auto\", \"none\" or a profile file, got {value!r}")
            if value not in ("auto", "none"):
                value = str(_relative_to(value, source))
                _load_profile(value, source)
            values[key] = value
        elif key == "baseline":
            if not isinstance(value, str) or not value:
                raise UsageError(f"{source}: baseline must be a file path, got {value!r}")
            values[key] = value
        else:
            known = ", ".join(sorted(top | set(_SECTIONS)))
            raise UsageError(f"{source}: unknown setting {key!r} (known: {known})")
    return Config(**values)


def _relative_to(path: str, source: str) -> Path:
    """``path`` as written in the config file ``source`` names: relative to that file's folder."""
    p = Path(path)
    config_file = Path(source.split(" [", 1)[0])
    return p if p.is_absolute() or not config_file.is_file() else config_file.parent / p


def _load_profile(path: str, source: str | None) -> AttentionProfile | None:
    if path in ("auto", "none"):
        return None
    try:
        return AttentionProfile.load(path)
    except OSError as exc:
        raise UsageError(f"{source or 'config'}: cannot read attention profile {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"{source or 'config'}: {exc}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets the decoding error through
        raise UsageError(f"{path}: not valid TOML: not UTF-8 at byte {exc.start}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _severity(key: str, value: Any, source: str) -> str:
    if value not in SEVERITIES:
        raise UsageError(f"{source}: {key} must be one of {', '.join(SEVERITIES)}, got {value!r}")
    return value


def _rule_ids(key: str, ids: list[Any], source: str, *, rules_only: bool = False) -> list[str]:
    for rid in ids:
        # a string first: a list or table in the list is no id (and cannot be looked up)
        ok = isinstance(rid, str) and (rid in RULES or (not rules_only and rid in _CHECK_NAMES))
        if not ok:
            what = "a check/rule id" if rules_only else "a check or a check/rule id"
            raise UsageError(f"{source}: {key}: {rid!r} is not {what} (see `kvdoctor check --list-rules`)")
    return list(ids)


def _section(name: str, table: Any, source: str) -> Any:
    cls = _SECTIONS[name]
    if not isinstance(table, dict):
        raise UsageError(f"{source}: {name} must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        f = fields.get(key)
        if f is None:
            raise UsageError(f"{source}: unknown setting {name}.{key} (known: {', '.join(fields)})")
        want = type(f.default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and not isinstance(value, int)):
            kind = "an integer" if want is int else "a number"
            raise UsageError(f"{source}: {name}.{key} must be {kind}, got {value!r}")
        kwargs[key] = want(value)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise UsageError(f"{source}: {exc}") from None
