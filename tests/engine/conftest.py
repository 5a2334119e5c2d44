"""Fixtures for the engine-core tests: a tiny cache wired to an event list, and a token writer
that remembers what it wrote so tests can compare bytes read back."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kvdoctor.engine.cache import PagedKVCache

from engine_support import Recorder, tiny_config


@pytest.fixture
def make_cache(tmp_path) -> Callable[..., Recorder]:
    made: list[PagedKVCache] = []

    def make(**kw: Any) -> Recorder:
        kw.setdefault("disk_dir", str(tmp_path))
        cache = PagedKVCache(tiny_config(**kw))
        made.append(cache)
        return Recorder(cache)

    yield make
    for c in made:
        c.close()
