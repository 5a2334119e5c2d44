"""kvdoctor.observe on transformers' own caches: silent and output-neutral on clean generate calls,
and a finding naming sequence, block or position, layer and step for each misuse of a cache."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, StaticCache

import kvdoctor
from kvdoctor.checks import make_suite
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.events import Attn, Batch, Read, Rollback, SeqStart, Write
from kvdoctor.findings import split_frame
from kvdoctor.trace import TraceReader, read_header

PAD = 0


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(num_layers=2, seed=3).model


def _events(path):
    return [e for batch in TraceReader(path).batches() for e in batch]


def _findings(path):
    suite = make_suite()
    return suite.observe_many(_events(path)) + suite.finish()


def _rules(findings):
    return sorted({f"{f.check}/{f.rule}" for f in findings})


def _prompts(batch=2, length=9, pad=(0, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pad[:batch]):
        ids[row, :n], mask[row, :n] = PAD, 0
    return ids, mask


def _observed(model, path, call):
    with kvdoctor.observe(model, trace=path):
        return call()


# ---- clean runs: identical outputs, no finding -------------------------------------

CLEAN = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, top_k=20, num_return_sequences=2),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", sorted(CLEAN))
def test_a_clean_left_padded_generate_is_silent_and_its_output_unchanged(tiny, tmp_path, mode):
    # GIVEN a batch of two prompts, one left-padded
    ids, mask = _prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=PAD, **CLEAN[mode])

    def run():
        torch.manual_seed(7)
        return tiny.generate(ids, **kwargs)

    # WHEN it is generated with and without the observer
    observed = _observed(tiny, tmp_path / "run.kvtrace", run)
    plain = run()
    # THEN the tokens are identical and the trace has writes, reads, statistics and no finding
    assert torch.equal(observed, plain)
    events = _events(tmp_path / "run.kvtrace")
    kinds = {type(e) for e in events}
    assert {SeqStart, Batch, Write, Read, Attn} <= kinds
    assert _findings(tmp_path / "run.kvtrace") == []
    # padding is no sequence's: the padded row's prompt is 5 tokens, written from position 0
    first = next(e for e in events if type(e) is Batch)
    assert first.n[0] == 9 and first.n[-1] == 5 and set(first.positions) == {0}


def test_assisted_decoding_and_a_continued_cache_are_silent(tiny, tmp_path):
    # GIVEN a prompt generated with an assistant, then continued from the cache it returned
    ids, _ = _prompts(batch=1, pad=(0,))
    assistant = tiny_llama(num_layers=1, seed=5).model

    def run():
        first = tiny.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=PAD, assistant_model=assistant,
                              return_dict_in_generate=True)
        more = torch.cat([first.sequences, torch.tensor([[5, 6, 7]])], dim=1)
        return tiny.generate(more, cache=first.cache, max_new_tokens=6, do_sample=False, pad_token_id=PAD)

    # WHEN both calls run observed and plain
    observed = _observed(tiny, tmp_path / "run.kvtrace", run)
    # THEN the outputs agree, the assistant's crops became rollbacks, and nothing is found
    assert torch.equal(observed, run())
    assert any(type(e) is Rollback for e in _events(tmp_path / "run.kvtrace"))
    assert _findings(tmp_path / "run.kvtrace") == []


def test_static_and_sliding_window_caches_are_silent(tmp_path):
    # GIVEN a Mistral-style model with a sliding window of 6 over a static cache and a dynamic one
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, sliding_window=6, pad_token_id=PAD)
    model = MistralForCausalLM(config).eval()
    ids, mask = _prompts()
    for name, make in (("static", lambda: StaticCache(config=config, max_cache_len=40)),
                       ("dynamic", lambda: DynamicCache(config=config))):
        def run():
            return model.generate(ids, attention_mask=mask, cache=make(), max_new_tokens=10, do_sample=False,
                                  pad_token_id=PAD)
        path = tmp_path / f"{name}.kvtrace"
        # WHEN generated under the observer
        observed = _observed(model, path, run)
        # THEN identical tokens, no finding, and sliding layers read only the window's blocks
        assert torch.equal(observed, run()), name
        assert _findings(path) == [], name


def _has(module):
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


QUANTIZED = [
    pytest.param("fp8", {}, id="fp8"),  # transformers' own backend: no dependency
    pytest.param("quanto", dict(nbits=4, q_group_size=16, residual_length=4), id="quanto",
                 marks=pytest.mark.skipif(not _has("optimum.quanto"), reason="optimum-quanto not installed "
                                          "(pip install 'kvdoctor[quantized]')")),
    pytest.param("hqq", dict(nbits=4, q_group_size=16, residual_length=4), id="hqq",
                 marks=pytest.mark.skipif(not _has("hqq"), reason="hqq not installed (pip install 'kvdoctor[quantized]')")),
]


@pytest.mark.parametrize("backend,options", QUANTIZED)
def test_a_quantized_cache_is_observed_like_a_dynamic_one(tiny, tmp_path, backend, options):
    # GIVEN a left-padded batch generated greedily, then with beam search, into transformers' QuantizedCache
    # (quanto, hqq: 4 bits, a residual of 4 tokens, so most reads come from dequantized K/V)
    from transformers import QuantizedCache

    ids, mask = _prompts()
    for mode, extra in (("greedy", {}), ("beam", dict(num_beams=2))):
        def run():
            return tiny.generate(ids, attention_mask=mask, cache=QuantizedCache(backend, tiny.config, **options),
                                 max_new_tokens=12, do_sample=False, pad_token_id=PAD, **extra)
        path = tmp_path / f"{mode}.kvtrace"
        # WHEN it runs with and without the observer
        observed = _observed(tiny, path, run)
        # THEN identical tokens, no finding, and the last read of the unpadded row covers its two blocks
        # (9 prompt + 11 generated tokens written before the last pass) at the positions written
        assert torch.equal(observed, run()), mode
        assert _findings(path) == [], mode
        events = _events(path)
        if mode == "greedy":
            seq = next(e for e in events if type(e) is Batch).rows[0]
            assert len([e for e in events if type(e) is Read and e.seq == seq][-1].blocks) == 2
            assert [e.pos for e in events if type(e) is Write and e.seq == seq][:2] == [0, 9]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers' offloading needs CUDA streams")
def test_an_offloaded_cache_is_observed_on_cuda(tmp_path):
    # GIVEN a model on CUDA with DynamicCache(offloading=True) (layers move to the host and are prefetched back)
    model = tiny_llama(num_layers=2, seed=3).model.cuda()
    ids, mask = (t.cuda() for t in _prompts())

    def run():
        return model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config, offloading=True),
                              max_new_tokens=12, do_sample=False, pad_token_id=PAD)

    # WHEN it is generated under the observer
    observed = _observed(model, tmp_path / "run.kvtrace", run)
    # THEN identical tokens, writes and reads, and no finding
    assert torch.equal(observed, run())
    assert {Write, Read, Attn} <= {type(e) for e in _events(tmp_path / "run.kvtrace")}
    assert _findings(tmp_path / "run.kvtrace") == []


# ---- misuses: each one a finding ---------------------------------------------------

def _only(findings, rule):
    hits = [f for f in findings if f"{f.check}/{f.rule}" == rule]
    assert hits, _rules(findings)
    return hits[0]


def test_one_cache_reused_for_an_unrelated_prompt_is_a_read_of_another_sequences_blocks(tiny, tmp_path):
    # GIVEN one DynamicCache used for a first prompt, then for an unrelated, longer one
    cache = DynamicCache(config=tiny.config)
    a = torch.randint(3, 120, (1, 6))
    b = torch.randint(3, 120, (1, 20))
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        tiny.generate(a, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        tiny.generate(b, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    # THEN the second prompt's sequence read the first one's block, named with layer and step
    found = _only(_findings(tmp_path / "run.kvtrace"), "batch/read-not-owned")
    assert found.block is not None and found.layer == 0 and found.step >= 4 and found.seq is not None


def test_a_finding_names_the_users_lines_that_allocated_and_misused_the_cache(tiny, tmp_path):
    # GIVEN the reused cache of the test above, each generate call on a line of its own
    cache = DynamicCache(config=tiny.config)
    a, b = torch.randint(3, 120, (1, 6)), torch.randint(3, 120, (1, 20))
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        first = sys._getframe().f_lineno + 1
        tiny.generate(a, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        second = sys._getframe().f_lineno + 1
        tiny.generate(b, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    # THEN the finding starts at the second call (the unrelated prompt) and names the first (the block's allocation)
    found = _only(_findings(tmp_path / "run.kvtrace"), "batch/read-not-owned")
    starts, allocs = (split_frame(found.stacks[kind][0]) for kind in ("seq_start", "alloc"))
    here = Path(__file__).name, sys._getframe().f_code.co_name
    assert (Path(starts[0]).name, starts[2], starts[1]) == (*here, second)
    assert (Path(allocs[0]).name, allocs[2], allocs[1]) == (*here, first)
    assert found.code_location == (starts[0], second) and not Path(starts[0]).is_absolute()
    # AND only the user's frames are recorded: none of transformers', torch's or kvdoctor's
    events = _events(tmp_path / "run.kvtrace")
    frames = [f for e in events if getattr(e, "stack", None) for f in e.stack]
    assert frames and all(Path(split_frame(f)[0]).name == Path(__file__).name for f in frames)


def test_rows_swapped_between_calls_on_one_cache_are_found(tiny, tmp_path):
    # GIVEN a batch of two generated into one cache, continued with its rows in the other order
    ids, _ = _prompts(pad=(0, 0))
    cache = DynamicCache(config=tiny.config)
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        out = tiny.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        tiny.generate(out.flip(0), cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    findings = _findings(tmp_path / "run.kvtrace")
    # THEN each row's sequence read the block the other sequence owns
    found = _only(findings, "batch/read-not-owned")
    assert found.layer == 0 and found.block is not None
    assert len({f.seq for f in findings if f.rule == "read-not-owned"}) == 2


def test_a_batch_size_change_on_one_cache_is_a_batch_shape_finding_before_transformers_fails(tiny, tmp_path):
    # GIVEN a cache filled by a batch of two, then given a batch of three
    ids, _ = _prompts(pad=(0, 0))
    cache = DynamicCache(config=tiny.config)
    with pytest.raises(RuntimeError):
        with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
            tiny(input_ids=ids, cache=cache)
            tiny(input_ids=torch.randint(3, 120, (3, 1)), cache=cache)
    # THEN the trace closed and the pass that could not fit the cache is named
    found = _only(_findings(tmp_path / "run.kvtrace"), "batch/batch-shape")
    assert found.step == 1


def test_left_padding_with_position_ids_that_ignore_it_writes_at_the_wrong_position(tiny, tmp_path):
    # GIVEN a hand-written prefill of a left-padded batch with positions 0..T-1 for every row
    ids, mask = _prompts(pad=(0, 4))
    positions = torch.arange(ids.shape[1]).expand(2, -1)
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        tiny(input_ids=ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(config=tiny.config))
    # THEN the padded row's first real token was written at position 4, not 0
    findings = _findings(tmp_path / "run.kvtrace")
    found = _only(findings, "batch/batch-position")
    assert found.evidence["position"] == 4 and found.step == 0
    assert found.evidence["cascade"]["rules"] == {"batch/write-position": 1}  # the write that followed: one cause


@pytest.mark.parametrize("crop", [-30, 30])
def test_a_crop_past_what_was_written_is_a_rollback_count_finding(tiny, tmp_path, crop):
    # GIVEN 9 tokens in a cache, cropped by 30 (everything and more) or, in the old form, to length 30
    ids, _ = _prompts(batch=1, pad=(0,))
    cache = DynamicCache(config=tiny.config)
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        tiny(input_ids=ids, cache=cache)
        try:
            cache.crop(crop)
        except ValueError:  # transformers 5 refuses the old form; the finding is recorded before
            pass
    found = _only(_findings(tmp_path / "run.kvtrace"), "stale/rollback-count")
    # THEN it names the sequence and what it held
    assert found.seq is not None and found.evidence["length"] == 9
    assert any(type(e) is Rollback for e in _events(tmp_path / "run.kvtrace"))


def test_a_beam_reorder_applied_twice_is_found(tiny, tmp_path):
    # GIVEN beam search over a cache whose reorder_cache applies the beam indices twice
    ids, _ = _prompts(batch=1, pad=(0,))

    class TwiceReordered(DynamicCache):
        def reorder_cache(self, beam_idx):
            super().reorder_cache(beam_idx)
            super().reorder_cache(beam_idx)

    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        tiny.generate(ids, cache=TwiceReordered(config=tiny.config), num_beams=4, max_new_tokens=10,
                      do_sample=False, pad_token_id=PAD)
    # THEN a beam read blocks of a hypothesis it does not continue
    found = _only(_findings(tmp_path / "run.kvtrace"), "batch/read-not-owned")
    assert found.layer == 0 and found.step >= 1


# ---- hand-written decode loops: model(...) with the cache, no generate ------------------

def _hand_decode(model, ids, mask, cache, steps, positions=True):
    """Greedy decoding the way people write it by hand: the 2D mask grows by one per step, and the
    positions (when given) count each row's real tokens. Returns the last logits and the mask."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0) if positions else None
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache)
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        pos = pos[:, -1:] + 1 if positions else None
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache)
    return out.logits, mask


def test_a_clean_hand_written_loop_is_silent_and_its_logits_unchanged(tiny, tmp_path):
    # GIVEN a left-padded batch decoded by hand for 8 steps, positions counting real tokens
    ids, mask = _prompts()

    def run():
        return _hand_decode(tiny, ids, mask, DynamicCache(config=tiny.config), 8)[0]

    # WHEN it runs with and without the observer
    observed = _observed(tiny, tmp_path / "run.kvtrace", run)
    # THEN the logits are identical and nothing is found
    assert torch.equal(observed, run())
    assert _findings(tmp_path / "run.kvtrace") == []


def test_a_hand_loop_feeding_a_new_prompt_to_a_used_cache_reads_the_old_sequences_blocks(tiny, tmp_path):
    # GIVEN a cache decoded for one prompt, then given another prompt with the mask a tokenizer makes for it
    # (as long as the new prompt only: the caller's sequence starts here, the cache's does not)
    a, mask_a = _prompts(batch=1, pad=(0,))
    b, mask_b = _prompts(batch=1, length=12, pad=(0,), seed=5)
    cache = DynamicCache(config=tiny.config)
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        _hand_decode(tiny, a, mask_a, cache, 4, positions=False)
        _hand_decode(tiny, b, mask_b, cache, 2, positions=False)
    # THEN the new prompt's sequence read the first one's block, at layer 0 of the new prompt's step
    found = _only(_findings(tmp_path / "run.kvtrace"), "batch/read-not-owned")
    assert found.layer == 0 and found.step == 5 and found.block == 0


def test_a_hand_loop_that_swaps_rows_is_a_position_finding_for_each(tiny, tmp_path):
    # GIVEN a left-padded batch decoded by hand, then one step with rows, mask and positions in the other order
    ids, mask = _prompts()
    cache = DynamicCache(config=tiny.config)
    with kvdoctor.observe(tiny, trace=tmp_path / "run.kvtrace"):
        logits, mask = _hand_decode(tiny, ids, mask, cache, 3)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        pos = mask.sum(-1, keepdim=True) - 1
        tiny(input_ids=nxt.flip(0), attention_mask=mask.flip(0), position_ids=pos.flip(0), cache=cache)
    # THEN both rows are written at the position the other sequence had reached
    (found,) = [f for f in _findings(tmp_path / "run.kvtrace") if f.rule in ("batch-position", "write-position")]
    cascade = found.evidence["cascade"]
    assert found.step == 4 and cascade["steps"] == [4, 4] and cascade["num_sequences"] == 1
    assert "batch/write-position" in cascade["rules"]


def test_without_a_trace_path_the_observer_follows_KVDOCTOR_TRACE(tiny, tmp_path, monkeypatch):
    path = tmp_path / "env.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    ids, _ = _prompts(batch=1, pad=(0,))
    with kvdoctor.observe(tiny) as obs:
        tiny.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    obs.trace.close()
    assert any(type(e) is Write for e in _events(path))


def test_an_observers_trace_joins_the_runs_other_traces_and_says_when_it_started(tiny, tmp_path, monkeypatch):
    # GIVEN KVDOCTOR_TRACE already written in this run by another writer (the engine, another process)
    path = tmp_path / "run.kvtrace"
    path.write_text("another writer's trace\n")
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    before = time.time_ns()
    ids, _ = _prompts(batch=1, pad=(0,))
    with kvdoctor.observe(tiny) as obs:
        tiny.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    obs.trace.close()
    # THEN the observer writes beside it, not over it, and its header gives the wall clock of its t = 0
    assert path.read_text() == "another writer's trace\n"
    header = read_header(tmp_path / "run.2.kvtrace")
    assert before <= header.t0 <= time.time_ns() and header.pid == os.getpid()


# ---- the embedded SmolLM2 ----------------------------------------------------------

@pytest.mark.slow
def test_smollm2_clean_batched_generate_is_silent_and_a_reused_cache_is_found(tmp_path):
    from kvdoctor.engine.model.model import load_model

    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    tok.padding_side = "left"
    enc = tok(["The capital of France is", "Two plus two equals four, and three plus three"], return_tensors="pt",
              padding=True)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    # GIVEN a clean batched left-padded greedy generate: identical tokens, no finding
    observed = _observed(model, tmp_path / "clean.kvtrace", lambda: model.generate(**enc, **kwargs))
    assert torch.equal(observed, model.generate(**enc, **kwargs))
    assert _findings(tmp_path / "clean.kvtrace") == []
    # WHEN one cache is reused for an unrelated prompt
    cache = DynamicCache(config=model.config)
    with kvdoctor.observe(model, trace=tmp_path / "reuse.kvtrace"):
        model.generate(**tok(["Hello"], return_tensors="pt"), cache=cache, **kwargs)
        model.generate(**tok(["A completely different and much longer question about the sea and the sky"],
                             return_tensors="pt"), cache=cache, **kwargs)
    # THEN the second prompt's sequence read the first one's block
    found = _only(_findings(tmp_path / "reuse.kvtrace"), "batch/read-not-owned")
    assert found.layer == 0 and found.block is not None
