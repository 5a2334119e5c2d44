"""transformers' generate on kvdoctor's cache: same tokens as its default cache, with the engine's events."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvdoctor.engine.hf import ATTN_IMPLEMENTATION, EngineCache, use_kvdoctor_attention
from kvdoctor.engine.model import tiny_llama
from kvdoctor.events import Attn, Batch, Read, Rollback, SeqEnd, SwapIn, SwapOut, Write


@pytest.fixture()
def model():
    m = tiny_llama().model
    yield m
    m.set_attn_implementation("sdpa")


def _generate(model, ids, mask=None, cache=None, n=16):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, cache=cache,
                          output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("attn", ["sdpa", ATTN_IMPLEMENTATION])
def test_generate_on_the_engine_matches_the_default_cache(model, attn):
    # GIVEN a left-padded batch of two prompts of different lengths
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    ref = _generate(model, ids, mask)
    model.set_attn_implementation(attn)
    # WHEN generate runs with an EngineCache instead of its DynamicCache
    with EngineCache(model, block_size=4, device_blocks=32, host_blocks=0) as cache:
        seen = []
        cache.bus.subscribe(seen.extend)
        out = _generate(model, ids, mask, cache)
    # THEN the tokens are identical and the logits agree
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=0)
    kinds = Counter(type(e) for e in seen)
    assert kinds[Batch] == 16 and kinds[Read] == 32 and kinds[Write] > 0 and kinds[SeqEnd] == 2
    # AND statistics come only from the kvdoctor attention implementation: one per row, layer and step
    assert kinds[Attn] == (16 * 2 * 2 if attn == ATTN_IMPLEMENTATION else 0)


def test_swaps_between_generate_calls_keep_the_tokens(model):
    # GIVEN a conversation continued over two generate calls, its blocks swapped out in between
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    use_kvdoctor_attention(model)
    cache = EngineCache(model, block_size=4, device_blocks=16, host_blocks=2, disk_blocks=16)
    seen = []
    cache.bus.subscribe(seen.extend)
    first = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, cache=cache)
    eng = cache.engine
    blocks = eng.block_table("hf0")
    eng.swap_out(blocks[:2], dst="host")
    eng.swap_out(blocks[2:], dst="disk")
    # WHEN generation continues from the first call's output
    second = model.generate(first, max_new_tokens=12, do_sample=False, pad_token_id=0, cache=cache)
    cache.close()
    # THEN the blocks came back from host and disk and the result equals one uninterrupted generate
    assert second.tolist() == ref.tolist()
    ins = {(e.src, e.dst) for e in seen if isinstance(e, SwapIn)}
    assert ins == {("host", "device"), ("disk", "device")}
    assert any(isinstance(e, SwapOut) for e in seen)


def test_crop_rolls_the_engine_back(model):
    cache = EngineCache(model, block_size=4, device_blocks=16, host_blocks=0)
    seen = []
    cache.bus.subscribe(seen.extend)
    model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, do_sample=False, pad_token_id=0, cache=cache)
    length = cache.get_seq_length()
    cache.crop(-3)
    assert cache.get_seq_length() == length - 3
    cache.close()
    assert any(isinstance(e, Rollback) and e.n == 3 for e in seen)


def test_engine_cache_needs_a_model_or_an_engine():
    with pytest.raises(ValueError, match="exactly one"):
        EngineCache()
