"""Hypothesis profiles, and the benchmark scripts as modules.

Hypothesis: CI draws the same examples every run, a developer's run explores new ones.

A property test that fails one random draw in thirty would otherwise fail CI at random (two did, on
tolerances, in one day); derandomized, a CI failure reproduces, and `./kvd test` run by hand still
searches afresh. ``.ci/run`` selects the profile with ``KVDOCTOR_HYPOTHESIS=ci``.
"""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType
from typing import Callable

import pytest
from hypothesis import settings

from kvdoctor import knobs

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(knobs.get(knobs.HYPOTHESIS))


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], ModuleType]:
    """A script of ``benchmarks/`` by name, imported as a module (they are scripts, not a package)."""

    def load(name: str) -> ModuleType:
        path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
