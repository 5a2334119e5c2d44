"""Fixtures of the check tests: ``trace`` is a fresh ``TraceBuilder``."""

from __future__ import annotations

import pytest

from tracebuilder import TraceBuilder


@pytest.fixture
def trace() -> TraceBuilder:
    return TraceBuilder()
