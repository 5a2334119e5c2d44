"""Packaging and layering guards: one distribution, one import package, and the layers of ARCHITECTURE.md."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvdoctor": "kvdoctor", "engine": "kvdoctor.engine", "checks": "kvdoctor.checks"}

# What each layer may import from kvdoctor itself. The trace format is part of the contract, so the
# engine may write traces; checks see events and findings only.
ALLOWED = {
    "kvdoctor.engine": ("kvdoctor.events", "kvdoctor.trace", "kvdoctor.errors", "kvdoctor.knobs", "kvdoctor.engine"),
    "kvdoctor.checks": ("kvdoctor.events", "kvdoctor.findings", "kvdoctor.knobs", "kvdoctor.checks"),
    # Producers for other engines: another engine's trace must not depend on ours.
    "kvdoctor.integrations": ("kvdoctor.events", "kvdoctor.trace", "kvdoctor.errors", "kvdoctor.knobs",
                              "kvdoctor.integrations"),
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


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layering(layer):
    # GIVEN the sources of a layer THEN they import only what ARCHITECTURE.md's table allows
    bad = []
    for path in _sources():
        if not _package_of(path).startswith(layer):
            continue
        for name in _imports(path):
            if name.startswith("kvdoctor") and not name.startswith(ALLOWED[layer]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if name.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(layer, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


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
    assert "kvdoctor/engine/matvec.c" in names  # the decode kernel's source, compiled on first use
