"""What a decode batch's shorter rows read past their own keys (the rest of a last block, the padding of the
table: slot 0, another sequence's block) reaches no row's attention, whatever those slots hold: a NaN left
there must not leak through a zero probability (0 × NaN is NaN; vLLM PR #43990's class, in kvdoctor's engine)."""

from __future__ import annotations

import math

import pytest

from kvdoctor.checks import make_suite
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]  # rows of 2 to 39 keys in one batch


def _generate(compiled: bool, poison: bool, monkeypatch) -> tuple[list[list[int]], list]:
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "1" if compiled else "0")
    model = tiny_llama(hidden_size=128, intermediate_size=256, num_layers=4).model
    suite = make_suite()
    with Runner.create(model, block_size=4, device_blocks=96, host_blocks=0) as runner:
        runner.generate(PROMPTS, max_new_tokens=2)  # the arena grows (zeroed), then its blocks are free again
        if poison:  # every slot of the arena holds NaN until a write replaces it, as a freed block keeps its bytes
            for layer in runner.cache.layout.views():
                layer.fill_(math.nan)
        runner.bus.subscribe(suite.observe_many)
        gens = runner.generate(PROMPTS, max_new_tokens=8)
        runner.bus.flush()
    suite.finish()
    return [g.token_ids for g in gens], suite.findings


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-layers", "torch-layers"])
def test_nan_in_slots_no_row_wrote_changes_no_token(monkeypatch, compiled):
    # GIVEN a device arena whose free blocks are full of NaN, and four prompts of different lengths decoded in one
    # batch
    clean, _ = _generate(compiled, poison=False, monkeypatch=monkeypatch)
    poisoned, findings = _generate(compiled, poison=True, monkeypatch=monkeypatch)
    # THEN every row generates what it generates over a clean arena, and nothing was read that no write produced
    assert poisoned == clean
    assert findings == []
