"""transformers' generate on kvdoctor's cache: same tokens as its default cache, with the engine's events."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from engine_support import contrastive_search, kinds_of, traced
from kvdoctor.checks import make_suite
from kvdoctor.engine import CacheMisuse
from kvdoctor.engine.model.hf import ATTN_IMPLEMENTATION, EngineCache, use_kvdoctor_attention
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.events import (Alloc, Batch, Free, Read, Release, Rollback, SeqEnd, SeqStart, Share, SwapIn,
                             SwapOut, Write, attn_rows)


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
    assert len(attn_rows(seen)) == (16 * 2 * 2 if attn == ATTN_IMPLEMENTATION else 0)


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
    blocks = eng.block_table("gen1.row0")
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


@pytest.mark.parametrize("other", [dict(num_layers=3), dict(num_kv_heads=4), dict(hidden_size=128)],
                         ids=["more layers", "more KV heads", "larger heads"])
@pytest.mark.parametrize("used_first", [False, True], ids=["fresh", "used"])
def test_another_models_shapes_are_a_clear_error(model, other, used_first):
    # GIVEN a cache built for one model, fresh or already used by it
    cache = EngineCache(model, device_blocks=32)
    ids = torch.tensor([[5, 6, 7, 8]])
    if used_first:
        _generate(model, ids, cache=cache, n=2)
        cache.finish()
    # WHEN another model generates on it THEN the error names both shapes and what to do, before the model fails
    with pytest.raises(CacheMisuse, match=r"built for a model of 2 layers with 2 KV heads of 16 dims, but the "
                                          r"model passed .*: build one EngineCache per model") as err:
        _generate(tiny_llama(seed=1, **other).model, ids, cache=cache, n=2)
    assert err.value.what == "shapes"


def test_a_batch_of_another_size_on_live_rows_is_a_clear_error_and_a_finding(model):
    # GIVEN a cache whose rows a first generate call left (no finish())
    cache = EngineCache(model, device_blocks=32)
    suite = make_suite()
    cache.bus.subscribe(suite.observe_many)
    _generate(model, torch.tensor([[5, 6, 7, 8]]), cache=cache, n=2)
    # WHEN a batch of two generates on it
    with pytest.raises(CacheMisuse, match=r"holds 1 row\(s\) \(gen1\.row0\) from an earlier generate call, but the "
                                          r"model passed a batch of 2: call cache.finish\(\)") as err:
        _generate(model, torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), cache=cache, n=2)
    assert err.value.what == "batch"
    # THEN the trace holds the batch the engine was asked for, and the checks name it
    cache.close()
    assert [f"{f.check}/{f.rule}" for f in suite.findings + suite.finish()] == ["batch/batch-shape"]


def test_an_unrelated_prompt_on_used_rows_is_a_clear_error_and_a_finding_and_a_continued_one_is_not(model):
    # GIVEN a cache whose row a first generate call left
    cache = EngineCache(model, device_blocks=32)
    suite = make_suite()
    cache.bus.subscribe(suite.observe_many)
    first = _generate(model, torch.tensor([[5, 6, 7, 8]]), cache=cache, n=3).sequences
    # WHEN the next call continues the conversation THEN it runs on the row
    second = _generate(model, torch.cat([first, torch.tensor([[9, 10]])], dim=1), cache=cache, n=2).sequences
    assert second[0, : first.shape[1]].tolist() == first[0].tolist()
    # WHEN a call passes an unrelated prompt THEN it is refused with where it stops continuing them
    with pytest.raises(CacheMisuse, match=r"rows \(gen1\.row0\) hold 10 tokens from an earlier generate call, and "
                                          r"this call's prompt differs from them at position 0") as err:
        _generate(model, torch.tensor([[50, 60, 70, 80, 90, 100, 110, 120, 10, 11, 12]]), cache=cache, n=2)
    assert err.value.what == "prompt"
    # AND the trace holds the pass it would have made, a prompt from position 0 on a row holding 10 tokens
    found = [f for f in suite.findings if f.rule == "batch-position"]
    assert len(found) == 1 and found[0].seq == "gen1.row0" and "holds 10 cached tokens" in found[0].message
    # AND after finish() the same prompt is a new row; after close() the model is as it was
    cache.finish()
    _generate(model, torch.tensor([[50, 60, 70]]), cache=cache, n=2)
    cache.close()
    assert [f"{f.check}/{f.rule}" for f in suite.findings + suite.finish()] == ["batch/batch-position"]
    assert "prepare_inputs_for_generation" not in vars(model)


def test_sequences_are_named_by_generate_call_and_row(model):
    cache = EngineCache(model, device_blocks=32)
    _generate(model, torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), cache=cache, n=2)
    assert cache.seqs == ["gen1.row0", "gen1.row1"]
    cache.finish()
    _generate(model, torch.tensor([[5, 6, 7, 8]]), cache=cache, n=2)
    assert cache.seqs == ["gen2.row0"]
    cache.close()


def test_crop_takes_transformers_negative_count(model):
    # GIVEN a cache holding a prompt (transformers 5 crops with -n; a positive count was "crop to length")
    with EngineCache(model, block_size=4, device_blocks=16, host_blocks=0) as cache:
        model(torch.tensor([[5, 6, 7, 8, 9]]), cache=cache)
        # WHEN crop is asked for a positive count THEN it is refused, as DynamicCache refuses it
        with pytest.raises(ValueError, match="negative"):
            cache.crop(2)
        # AND crop(0) keeps everything
        cache.crop(0)
        assert cache.get_seq_length() == 5


PADDED = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])  # two prompts, the first left-padded


@pytest.mark.parametrize("options", [
    dict(num_beams=3, num_return_sequences=2),
    dict(do_sample=True, num_return_sequences=3),
], ids=["beam-search", "sampled-return-sequences"])
def test_beam_search_and_return_sequences_match_the_default_cache(model, tmp_path, monkeypatch, options):
    # GIVEN a left-padded batch of two prompts, and generate's result with its DynamicCache
    def generate(cache=None):
        torch.manual_seed(0)
        return model.generate(PADDED, attention_mask=(PADDED != 0).long(), max_new_tokens=8, pad_token_id=0,
                              cache=cache, output_scores=True, return_dict_in_generate=True, **options)

    ref = generate()
    # WHEN the same generate runs on an EngineCache that writes a trace
    out, events, findings = traced(model, tmp_path, monkeypatch, generate)
    # THEN the sequences and scores are identical
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), atol=1e-4, rtol=0)
    if "num_beams" in options:
        torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)
        # AND the beams' reorders show as blocks shared and released, never as K/V written again
        kinds = kinds_of(events)
        assert kinds[Share] and kinds[Release]
        assert sum(e.n for e in events if isinstance(e, Write)) == PADDED.numel() * options["num_beams"] + (
            8 - 1) * 2 * options["num_beams"]  # each token of each row is written once: the prompts, then one a step
    # AND every check finds nothing in the trace
    assert findings == [], "\n".join(f.message for f in findings)


def test_assisted_and_prompt_lookup_decoding_match_greedy(model, tmp_path, monkeypatch):
    # GIVEN greedy decoding's tokens, and an assistant that disagrees with the model (another random init)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 3, 4, 5]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assistant = tiny_llama(seed=1).model
    for name, options in [("assisted", dict(assistant_model=assistant)), ("lookup", dict(prompt_lookup_num_tokens=3))]:
        # WHEN the model verifies drafts on an EngineCache (rejected drafts are cropped from it)
        out, events, findings = traced(
            model, tmp_path, monkeypatch, name=name,
            run=lambda cache: model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, cache=cache,
                                             **options))
        # THEN the tokens are greedy decoding's, the crops were rollbacks, and the checks find nothing
        assert out.tolist() == ref.tolist(), name
        assert kinds_of(events)[Rollback], name
        assert findings == [], "\n".join(f.message for f in findings)


def test_contrastive_search_matches_the_default_cache(model, tmp_path, monkeypatch):
    # GIVEN contrastive search's tokens on DynamicCache for two prompts
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 5, 6, 7]])
    ref_ids, ref_logits = contrastive_search(model, ids, DynamicCache(config=model.config))
    # WHEN it runs on an EngineCache: every step forks each row twice and keeps one of three
    (got_ids, got_logits), events, findings = traced(
        model, tmp_path, monkeypatch, lambda cache: contrastive_search(model, ids, cache))
    # THEN the tokens, and the logits after the final crop, are DynamicCache's
    assert got_ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=0)
    # AND the candidates were forks that shared their row's blocks, the losers ended as aborted
    kinds = kinds_of(events)
    assert kinds[SeqStart] == 2 + 6 * 2 * 2 and kinds[Share]
    assert sum(e.reason == "aborted" for e in events if isinstance(e, SeqEnd)) == 6 * 2 * 2
    assert findings == [], "\n".join(f.message for f in findings)


@pytest.mark.parametrize("ops", [
    [("reorder", [2, 2, 0])],
    [("select", [True, False, True]), ("repeat", 2), ("reorder", [3, 0, 0, 1])],
    [("repeat", 3), ("select", [8, 0, 4, 4])],
], ids=["reorder", "select-repeat-reorder", "repeat-select-duplicates"])
def test_row_operations_move_ownership_and_match_the_default_cache(model, ops):
    # GIVEN three rows of five tokens (a partial tail block each) in a DynamicCache and an EngineCache
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 5, 6, 7], [9, 8, 7, 6, 5]])
    dyn = DynamicCache(config=model.config)
    with EngineCache(model, block_size=4, device_blocks=64, host_blocks=0) as eng:
        for cache in (dyn, eng):
            model(ids, cache=cache)
        seen: list[Any] = []
        eng.bus.subscribe(seen.extend)
        # WHEN both get the same row operations
        for cache in (dyn, eng):
            for op, arg in ops:
                if op == "reorder":
                    cache.reorder_cache(torch.tensor(arg))
                elif op == "select":
                    cache.batch_select_indices(torch.tensor(arg))
                else:
                    cache.batch_repeat_interleave(arg)
        eng.bus.flush()
        moved = kinds_of(seen)
        # THEN the rows changed owners only: no block allocated, no token written
        assert not moved[Alloc] and not moved[Write] and moved[Share]
        assert moved[Free] <= moved[Release] + 8 * moved[SeqEnd]  # frees come only from letting go
        # AND the next step computes the same logits on both, each row on its own copy of shared tails
        nxt = torch.arange(10, 10 + len(eng.seqs))[:, None]
        want, got = model(nxt, cache=dyn).logits, model(nxt, cache=eng).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert len(set(eng.seqs)) == len(eng.seqs) == dyn.layers[0].keys.shape[0]


def test_row_operations_check_their_arguments(model):
    with EngineCache(model, block_size=4, device_blocks=16, host_blocks=0) as cache:
        model(torch.tensor([[5, 6, 7], [3, 4, 5]]), cache=cache)
        with pytest.raises(IndexError, match="2 rows"):
            cache.reorder_cache(torch.tensor([0, 2]))
        with pytest.raises(ValueError, match="repeats"):
            cache.batch_repeat_interleave(0)


def test_generate_runs_in_a_team_sized_to_the_cpus_others_leave_and_gives_it_back(model, monkeypatch):
    from kvdoctor.engine.model import threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        expected = _generate(model, ids, cache=EngineCache(model, device_blocks=32), n=6).sequences
        # GIVEN other processes holding all but one of this process's CPUs, read before every pass
        monkeypatch.setenv("KVDOCTOR_THREADS", "adaptive")
        monkeypatch.setattr(threads, "others_busy", lambda cpus, last: (len(cpus) - 1, (0.0, 0.0, 0.0)))
        teams = []
        monkeypatch.setattr(threads, "_resize", lambda team: (teams.append(team), torch.set_num_threads(team)))
        cache = EngineCache(model, device_blocks=32)
        cache.threads.interval = 0.0
        # WHEN generate runs on the engine THEN it computes in one thread, the same tokens
        assert _generate(model, ids, cache=cache, n=6).sequences.tolist() == expected.tolist()
        assert teams == [1]
        # AND finish() gives the user's two threads back
        cache.finish()
        assert teams == [1, 2] and torch.get_num_threads() == 2
        cache.close()
    finally:
        torch.set_num_threads(before)
