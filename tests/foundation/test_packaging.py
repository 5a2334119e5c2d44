"""Packaging and layering guards: one distribution, one import package, and the layers of docs/architecture.md."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvdoctor": "kvdoctor", "engine": "kvdoctor.engine", "checks": "kvdoctor.checks"}

CONTRACT = ("kvdoctor.events", "kvdoctor.errors", "kvdoctor.knobs", "kvdoctor.callsite")  # what every layer shares
TRACE_FORMAT = ("kvdoctor.trace", "kvdoctor.trace_input", "kvdoctor.binary_trace", "kvdoctor.trace_names")
UI = ("kvdoctor.cli", "kvdoctor.commands", "kvdoctor.tui")
ENGINE_SIDE = ("kvdoctor.engine", "kvdoctor.demo", "kvdoctor.compression", "kvdoctor.faults")  # import the engine, hence torch


@dataclass(frozen=True)
class Rule:
    """What the modules under a name may import from kvdoctor: only ``allowed`` (with their own package), or,
    where ``allowed`` is None, anything but ``forbidden``; ``why`` is said when a module breaks it."""

    why: str
    allowed: tuple[str, ...] | None = None
    forbidden: tuple[str, ...] = ()


# docs/architecture.md's layers, for every package and top-level module; a module follows the most specific name.
RULES = {
    "kvdoctor.events": Rule("the event contract is plain data every layer shares", allowed=()),
    "kvdoctor.errors": Rule("errors and exit codes are shared by every layer", allowed=()),
    "kvdoctor.knobs": Rule("every layer reads its environment variables here", allowed=()),
    "kvdoctor.callsite": Rule("every producer records the user's stack with it", allowed=()),
    "kvdoctor.findings": Rule("a finding points at events, nothing more", allowed=("kvdoctor.events",)),
    "kvdoctor.binary_trace": Rule("the trace format is events in, events out", allowed=CONTRACT),
    "kvdoctor.trace": Rule("the trace format is events in, events out", allowed=CONTRACT + TRACE_FORMAT),
    "kvdoctor.trace_input": Rule("opening a trace file or stream is part of the trace format", allowed=CONTRACT),
    "kvdoctor.trace_names": Rule("which file a trace goes to is part of the trace format", allowed=()),
    "kvdoctor.engine": Rule("the engine records events and writes its trace; it knows no consumer",
                            allowed=CONTRACT + TRACE_FORMAT + ("kvdoctor.attach",)),
    "kvdoctor.attach": Rule("asking a running process for its trace: the asker and the engine share it",
                            allowed=("kvdoctor.knobs", "kvdoctor.errors")),
    "kvdoctor.checks": Rule("checks are pure consumers of events", allowed=("kvdoctor.events", "kvdoctor.findings",
                                                                            "kvdoctor.knobs")),
    "kvdoctor.integrations": Rule("another engine's trace must not depend on ours", allowed=CONTRACT + TRACE_FORMAT),
    "kvdoctor.probes": Rule("probes read memory into events, light to import", allowed=CONTRACT),
    "kvdoctor.probes.machine": Rule("`kvdoctor doctor` asks the engine what it can use on this machine",
                                    allowed=CONTRACT + ("kvdoctor.engine",)),
    "kvdoctor.export": Rule("an export writes a session's events and findings for another tool",
                            allowed=CONTRACT + TRACE_FORMAT + ("kvdoctor.findings", "kvdoctor.config",
                                                               "kvdoctor.session", "kvdoctor.workload")),
    "kvdoctor.tui": Rule("the TUI is fed by a session; an engine runs in a child process (the demo), never in it",
                         forbidden=ENGINE_SIDE + ("kvdoctor.cli", "kvdoctor.commands", "kvdoctor.pytest_plugin")),
    "kvdoctor.commands": Rule("a command may use anything but the parser that lists it", forbidden=("kvdoctor.cli",)),
    "kvdoctor.cli": Rule("the parser is the top", forbidden=()),
    "kvdoctor": Rule("sessions, reports, config and metrics work from a trace without the engine, and never reach "
                     "up into the UI", forbidden=ENGINE_SIDE + UI),
    "kvdoctor.compression": Rule("the engine's codec settings, below the UI", forbidden=UI),
    "kvdoctor.demo": Rule("the demo workload drives the engine, below the UI", forbidden=UI),
    "kvdoctor.faults": Rule("the engine's faults as the command line offers them, below the UI", forbidden=UI),
    "kvdoctor.pytest_plugin": Rule("the plugin checks a test's engine, below the UI", forbidden=UI),
}
FORBIDDEN_THIRD_PARTY = {"kvdoctor.checks": ("torch", "transformers", "numpy", "textual")}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return ".".join([FOLDERS[rel.parts[0]], *rel.parts[1:-1]])


def _sources() -> list[Path]:
    return [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]


def test_every_package_folder_is_listed():
    # GIVEN every folder with an __init__.py under the three roots THEN pyproject lists it as a package
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {_package_of(init) for init in _sources() if init.name == "__init__.py"}
    assert found == listed, f"unlisted: {found - listed}; listed but missing: {listed - found}"


def test_package_dir_maps_the_folders():
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {
        "kvdoctor.engine": "engine", "kvdoctor.checks": "checks"}


def _imports(path: Path) -> list[str]:
    """Absolute names of everything a module imports, with relative imports resolved."""
    package = _package_of(path)
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names += [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            else:
                names.append(node.module or "")
    return names


def _module_of(path: Path) -> str:
    package = _package_of(path)
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _rule_of(module: str) -> str:
    """The most specific name in RULES that ``module`` is or lies under."""
    return max((key for key in RULES if _under(module, (key,))), key=len)


def _own_package(path: Path) -> str:
    """What a module may always import: its subpackage of kvdoctor (tui/widgets/x.py: kvdoctor.tui), or itself."""
    package = _package_of(path)
    return _module_of(path) if package == "kvdoctor" else ".".join(package.split(".")[:2])


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layering(rule):
    # GIVEN every module that follows a rule THEN it imports from kvdoctor only what the rule allows
    bad = []
    for path in _sources():
        module = _module_of(path)
        if _rule_of(module) != rule:
            continue
        r = RULES[rule]
        for name in _imports(path):
            if not _under(name, ("kvdoctor",)) or _under(name, (_own_package(path),)):
                pass
            elif (r.allowed is not None and not _under(name, r.allowed)) or _under(name, r.forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}: {r.why}")
            if name.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(rule, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_a_layering_rule_catches_a_crossing_import():
    # GIVEN the checks importing the engine, and the TUI importing the demo THEN both break a rule
    assert _rule_of("kvdoctor.checks.leak") == "kvdoctor.checks" and not _under("kvdoctor.engine.kv.pool",
                                                                              RULES["kvdoctor.checks"].allowed)
    assert _rule_of("kvdoctor.tui.app") == "kvdoctor.tui" and _under("kvdoctor.demo", RULES["kvdoctor.tui"].forbidden)
    assert _rule_of("kvdoctor.session") == "kvdoctor" and _under("kvdoctor.engine.bus", RULES["kvdoctor"].forbidden)
    assert _own_package(ROOT / "kvdoctor/tui/widgets/blocks.py") == "kvdoctor.tui"
    assert _own_package(ROOT / "kvdoctor/report.py") == "kvdoctor.report"


def test_no_top_level_engine_or_checks_modules():
    # WHEN the whole package is imported THEN nothing is importable as top-level `engine` or `checks`
    code = ("import sys, kvdoctor.engine, kvdoctor.checks, kvdoctor.cli; "
            "bad=[m for m in sys.modules if m.split('.')[0] in ('engine','checks')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_cli_starts_without_torch():
    # `kvdoctor check --trace x` must stay fast: building the CLI imports no torch
    code = "import sys; from kvdoctor.cli import build_parser; build_parser(); assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.timeout(300)
def test_wheel_holds_only_kvdoctor(tmp_path):
    # WHEN a wheel is built THEN its only top-level folder is kvdoctor/ (plus its .dist-info)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvdoctor"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvdoctor/engine/bus.py" in names and "kvdoctor/checks/__init__.py" in names
    assert "kvdoctor/engine/kernels/matvec.c" in names  # the decode kernel's source, compiled on first use


# Inside the engine, its folders are layers: the native kernels under the KV core, model execution over the
# core, attention features over the model, serving over everything. A module at the engine's top
# (config, errors, bus, faults, paths) is vocabulary every layer shares.
ENGINE_LAYERS = ("kernels", "kv", "model", "features", "serving")


def _engine_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["kvdoctor", "engine"] or len(parts) < 4 or parts[2] not in ENGINE_LAYERS:
        return None
    return ENGINE_LAYERS.index(parts[2])


def test_engine_folders_are_layers():
    # GIVEN every module under engine/<layer>/ THEN it imports no engine module of a layer above its own
    bad = []
    for path in (ROOT / "engine").rglob("*.py"):
        own = _engine_layer(_module_of(path))
        if own is None:
            continue
        for name in _imports(path):
            layer = _engine_layer(name)
            if layer is not None and layer > own:
                bad.append(f"{path.relative_to(ROOT)} imports {name} ({ENGINE_LAYERS[layer]} is above "
                           f"{ENGINE_LAYERS[own]})")
    assert not bad, "\n".join(bad)


def test_the_engines_top_modules_import_no_layer():
    # GIVEN the engine's shared vocabulary (config, errors, bus, faults, paths) THEN it imports none of the
    # layers, except config naming the codecs it validates
    bad = [f"{path.name} imports {name}" for path in (ROOT / "engine").glob("*.py") if path.stem != "__init__"
           for name in _imports(path) if _engine_layer(name) is not None and not (
               path.stem == "config" and name == "kvdoctor.engine.kv.codecs")]
    assert not bad, "\n".join(bad)


def test_no_source_file_is_over_600_lines():
    # a module longer than that owns more than one concept (docs/architecture.md): split it by concept
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.c", "*.h"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    long = {p: n for p in tracked.stdout.split() if (n := len((ROOT / p).read_text().splitlines())) > 600}
    assert long == {}
