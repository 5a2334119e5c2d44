"""Fixtures for the engine-core tests: a tiny cache wired to an event list, and a token writer
that remembers what it wrote so tests can compare bytes read back."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kvdoctor.engine.kv.cache import PagedKVCache

from engine_support import Recorder, tiny_config


@pytest.fixture(scope="module")
def smol():
    """The embedded SmolLM2, loaded once per module that asks for it (the slow modules)."""
    from kvdoctor.engine.model.model import load_model

    return load_model()


@pytest.fixture(scope="module")
def one_thread():
    # CI runners and shared machines are oversubscribed; with two OpenMP threads each small
    # decode matmul can wait on a descheduled thread, making the run several times slower.
    # One thread keeps a module's time predictable (SmolLM2 modules use it).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
