"""Long context on the embedded SmolLM2-135M (slow: loads the model): a context 4x the device tier."""

from __future__ import annotations

import pytest

from kvdoctor.checks import make_suite
from kvdoctor.engine.kv.codecs import calibration_text
from kvdoctor.engine.model.model import load_model
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.trace import TraceReader

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():
    return load_model()


@pytest.fixture
def one_thread():
    """Small decode steps on a shared 2-core machine: one torch thread, as OpenMP spinning slows them many times."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_dense_streamed_at_4x_the_device_gives_the_resident_greedy_tokens_with_a_clean_trace(loaded, tmp_path,
                                                                                            monkeypatch, one_thread):
    # GIVEN 192 tokens of text and a device tier of 3 blocks of 16 (48 tokens): 4x the device
    ids = loaded.tokenizer(calibration_text())["input_ids"][:192]
    resident = Runner.create(loaded.model, stats_every=0, block_size=16, device_blocks=16, host_blocks=0)
    want = resident.generate([ids], max_new_tokens=6)[0].token_ids
    resident.close()
    # WHEN it runs streamed from host and disk through a 4-block staging area, traced
    monkeypatch.setenv("KVDOCTOR_TRACE", str(tmp_path / "long.kvtrace"))
    streamed = Runner.create(loaded.model, block_size=16, device_blocks=3, host_blocks=4, disk_blocks=12,
                             staging_blocks=4, eviction="hybrid", disk_dir=str(tmp_path))
    got = streamed.generate([ids], max_new_tokens=6)[0].token_ids
    cache = streamed.cache
    streamed.close()
    # THEN the greedy tokens are identical, blocks really came from disk, and the checks find nothing
    assert got == want
    assert cache.rows_from_slower > 0 and "host->disk" in cache.stats()["swaps"]
    suite = make_suite()
    for ev in TraceReader(tmp_path / "long.kvtrace"):
        suite.observe(ev)
    findings = suite.findings + suite.finish()
    assert findings == [], [f.message for f in findings]
