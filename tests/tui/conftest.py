"""Fixtures of the TUI tests: synthetic traces (clean and with a leaked swapped-out block)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tui_helpers import write_synthetic


@pytest.fixture(scope="session")
def leak_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 steps of the synthetic workload; from step 60 swapped-out blocks of aborted requests leak."""
    return write_synthetic(tmp_path_factory.mktemp("tui") / "leak.kvtrace", num_steps=300, fault="leak-swapped")


@pytest.fixture(scope="session")
def clean_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("tui") / "clean.kvtrace", num_steps=150)
