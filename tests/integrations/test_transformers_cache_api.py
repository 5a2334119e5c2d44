"""transformers' cache API misused or misbehaving, on a real ``model.generate``: a cut (``crop``, ``reset``) that
leaves slots behind is found naming the cache, the layer and the step, and the next request's read of those
stale slots naming the sequence, the block, the positions and the layer. The bugs are reproduced by patching
transformers in-process the way the reports describe it; each has a clean twin on the fixed behaviour."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import kvdoctor
from kvdoctor.engine.model.model import tiny_llama

from test_transformers_observer import PAD, _events, _findings


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(num_layers=2, seed=3).model


def _zeroing_reset(self) -> None:
    """``DynamicLayer.reset`` before the fix of transformers #48509 / PR #48809: zeroed in place, so the length
    (read off the keys' shape) stays and the next update appends after stale zeros."""
    if self.is_initialized:
        self.keys.zero_()
        self.values.zero_()


def _slicing_crop(self, tokens_to_remove: int) -> None:
    """``DynamicLayer.crop`` before the fix of transformers #47433: an oversized negative crop slices ``[:-n]`` of
    the computed keep length, which Python reads from the end and so keeps tokens."""
    if tokens_to_remove == 0 or not self.is_initialized:
        return
    keep = self.get_seq_length() - abs(tokens_to_remove)
    self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]


def _prompt(length, seed):
    return torch.randint(3, 120, (1, length), generator=torch.Generator().manual_seed(seed))


def _second_request_after(tiny, path, cut):
    """A cache used for one request, cut by ``cut(cache)`` to start afresh, then used for another request."""
    cache = DynamicCache()
    with kvdoctor.observe(tiny, trace=path):
        tiny.generate(_prompt(10, 0), max_new_tokens=5, do_sample=False, cache=cache, pad_token_id=PAD)
        cut(cache)
        tiny.generate(_prompt(14, 1), max_new_tokens=4, do_sample=False, cache=cache, pad_token_id=PAD)
    return _findings(path)


def test_a_reset_that_keeps_the_old_length_is_found_and_so_is_the_read_of_its_stale_slots(tiny, tmp_path,
                                                                                            monkeypatch):
    # GIVEN reset() as transformers shipped it before #48809 (zeroes, keeps the length: transformers #48509)
    monkeypatch.setattr(DynamicLayer, "reset", _zeroing_reset)
    # WHEN a cache is reset between two requests
    findings = _second_request_after(tiny, tmp_path / "run.kvtrace", lambda cache: cache.reset())
    by_rule = {f"{f.check}/{f.rule}": f for f in findings}
    # THEN the cut names its cache, layer and step, and the second request's read names the stale positions
    cut = by_rule["slots/cut-length"]
    assert (cut.layer, cut.step) == (0, 5) and "reset() on cache c1" in cut.message
    assert "should leave 0 slots per row, but the cache reports 14" in cut.message
    read = by_rule["slots/unwritten-read"]
    assert (read.seq, read.layer, read.step) == ("c1.gen2.row0", 0, 5) and isinstance(read.block, int)
    assert read.evidence["positions"] == list(range(14))


def test_an_oversized_negative_crop_that_keeps_tokens_is_found(tiny, tmp_path, monkeypatch):
    # GIVEN crop as before the fix of transformers #47433; WHEN the whole cache and more is cropped
    monkeypatch.setattr(DynamicLayer, "crop", _slicing_crop)
    findings = _second_request_after(tiny, tmp_path / "run.kvtrace",
                                     lambda cache: cache.crop(-(cache.get_seq_length() + 3)))
    by_rule = {f"{f.check}/{f.rule}": f for f in findings}
    # THEN the crop left 11 of 14 slots, and the next request read them though nobody wrote them since
    assert "should leave 0 slots per row, but the cache reports 11" in by_rule["slots/cut-length"].message
    read = by_rule["slots/unwritten-read"]
    assert read.layer == 0 and read.evidence["positions"] == list(range(11))


def test_a_reset_as_transformers_does_it_now_leaves_nothing_to_find(tiny, tmp_path):
    # the clean twin of both: the cut empties the cache, the second request computes all its own K/V
    findings = _second_request_after(tiny, tmp_path / "run.kvtrace", lambda cache: cache.reset())
    assert findings == [], findings


def test_a_crop_that_rolls_back_generated_tokens_and_continues_is_clean(tiny, tmp_path):
    # GIVEN a request generated, its last three tokens cropped from the cache (a rejected continuation)
    cache = DynamicCache()
    path = tmp_path / "run.kvtrace"
    with kvdoctor.observe(tiny, trace=path):
        out = tiny.generate(_prompt(10, 0), max_new_tokens=6, do_sample=False, cache=cache, pad_token_id=PAD)
        cache.crop(-3)
        # WHEN generation continues from the kept tokens
        tiny.generate(out[:, :-3], max_new_tokens=4, do_sample=False, cache=cache, pad_token_id=PAD)
    # THEN the cut is recorded as asked and honoured, and nothing is found
    cuts = [e for e in _events(path) if type(e).__name__ == "Truncate"]
    assert [(c.op, c.keep, c.length) for c in cuts] == [("crop", 12, 12)]
    assert _findings(path) == []


def _positions_from_cache_position(model):
    """``prepare_inputs_for_generation`` as unsloth had it (unsloth #3699; transformers #48161 for right padding):
    ``position_ids`` set to ``cache_position``, one tensor shared by every row, so a left-padded row's tokens get
    the positions of its padding."""
    original = model.prepare_inputs_for_generation

    def prepare(*args, **kwargs):
        inputs = original(*args, **kwargs)
        ids = inputs["input_ids"]
        cache = inputs.get("cache", inputs.get("past_key_values"))
        start = cache.get_seq_length() if cache is not None else 0
        inputs["position_ids"] = torch.arange(start, start + ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
        return inputs

    prepare.__wrapped__ = original  # generate validates its arguments against the original's signature
    return prepare


@pytest.mark.parametrize("shared_positions", [True, False])
def test_position_ids_shared_by_a_left_padded_batch_are_found_naming_the_padded_row(tiny, tmp_path, monkeypatch,
                                                                                   shared_positions):
    # GIVEN a batch of two prompts, the second left-padded by four
    ids = _prompt(9, 0).repeat(2, 1)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = PAD, 0
    if shared_positions:  # WHEN position ids come from the shared cache position (the bug)
        monkeypatch.setattr(tiny, "prepare_inputs_for_generation", _positions_from_cache_position(tiny))
    path = tmp_path / "run.kvtrace"
    with kvdoctor.observe(tiny, trace=path):
        tiny.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    findings = _findings(path)
    if not shared_positions:  # the clean twin: positions from the mask
        assert findings == [], findings
        return
    # THEN the padded row is named: it computes from position 4 while it holds nothing yet
    (f,) = [f for f in findings if f.rule == "batch-position"]
    assert (f.seq, f.step, f.evidence["row"], f.evidence["position"]) == ("c1.gen1.row1", 0, 1, 4)
    assert {x.check for x in findings} == {"batch"}, findings


def _nan_at_padding(original):
    """``DynamicLayer.update`` as a half-precision overflow leaves it (transformers #46765, flash-attention #1745):
    the K/V the prefill computes for the padding slots of a left-padded row are NaN."""
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            value_states = value_states.clone()
            value_states[1, :, :4] = float("nan")  # row 1's four padding slots
        return original(self, key_states, value_states, *args, **kwargs)

    return update


@pytest.mark.parametrize("nan_padding", [True, False])
def test_nan_in_padding_slots_reaching_a_real_row_is_found_naming_the_row(tiny, tmp_path, monkeypatch, nan_padding):
    # GIVEN a batch of two prompts, the second left-padded by four, whose padding slots hold NaN
    ids = _prompt(9, 0).repeat(2, 1)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = PAD, 0
    if nan_padding:
        monkeypatch.setattr(DynamicLayer, "update", _nan_at_padding(DynamicLayer.update))
    path = tmp_path / "run.kvtrace"
    with kvdoctor.observe(tiny, trace=path):
        tiny.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    findings = _findings(path)
    if not nan_padding:
        assert findings == [], findings
        return
    # THEN the NaN is named where it was written: the padded row, its four padding slots, the first layer and the
    # step; and its effect after, the row's attention turning non-finite (0 x NaN through the masked slots)
    written, seen = findings
    assert (written.rule, written.seq, written.step, written.layer) == ("padding-nonfinite", "c1.gen1.row1", 0, 0)
    assert written.evidence["slots"] == [0, 1, 2, 3] and "padding slots 0-3 at layer 0" in written.message
    assert (seen.check, seen.rule, seen.seq, seen.step) == ("attention", "nonfinite", "c1.gen1.row1", 0)


def test_a_right_padded_batch_in_generate_computes_the_short_row_at_wrong_positions(tiny, tmp_path):
    # GIVEN a decoder-only generate with the second prompt right-padded by four (transformers #48161: position ids
    # kept and incremented per step, so the short row's new tokens never get its real length; transformers warns)
    ids = _prompt(9, 0).repeat(2, 1)
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = PAD, 0
    path = tmp_path / "run.kvtrace"
    with kvdoctor.observe(tiny, trace=path):
        tiny.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    # THEN the short row's first new token is named: it holds 5 tokens and computes elsewhere (the left-padded
    # twin is test_position_ids_shared_by_a_left_padded_batch_are_found_naming_the_padded_row[False])
    (f,) = [f for f in _findings(path) if f.rule == "batch-position"]
    assert (f.seq, f.step, f.evidence["row"], f.evidence["expected"]) == ("c1.gen1.row1", 1, 1, 5)
