"""generate's beam, assisted and contrastive modes on EngineCache with SmolLM2-135M: DynamicCache's tokens.

Slow (it loads the embedded model), so short: a few new tokens each. The kvdoctor attention
implementation runs throughout, so the traces hold attention statistics too, and every check
over every trace must find nothing.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine_support import contrastive_search, kinds_of, traced
from kvdoctor.engine.model.hf import use_kvdoctor_attention
from kvdoctor.engine.model.model import load_model, tiny_llama
from kvdoctor.events import AttnStep, Rollback, SeqStart, Share

pytestmark = pytest.mark.slow

TEXTS = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # oversubscribed CI machines: see test_runner_smollm2
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol():
    loaded = load_model()
    loaded.tokenizer.padding_side = "left"
    yield loaded
    loaded.model.set_attn_implementation("sdpa")


def assert_clean(findings) -> None:
    assert findings == [], "\n".join(f.message for f in findings)


def test_beam_search_with_return_sequences_matches_the_default_cache(smol, tmp_path, monkeypatch):
    # GIVEN two prompts of different lengths, left-padded, and beam search's result on DynamicCache
    batch = smol.tokenizer(TEXTS, return_tensors="pt", padding=True)
    options = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True,
                   return_dict_in_generate=True)
    ref = smol.model.generate(**batch, **options)
    # WHEN it runs on an EngineCache with the kvdoctor attention
    use_kvdoctor_attention(smol.model)
    out, events, findings = traced(smol.model, tmp_path, monkeypatch,
                                   lambda cache: smol.model.generate(**batch, cache=cache, **options))
    # THEN the beams, their scores and the trace are right
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=0)
    kinds = kinds_of(events)
    assert kinds[Share] and kinds[AttnStep]
    assert_clean(findings)


def test_assisted_decoding_matches_greedy(smol, tmp_path, monkeypatch):
    # GIVEN greedy decoding's tokens, and a small random assistant with SmolLM2's vocabulary (its drafts
    # are mostly rejected, so the main model's cache is cropped nearly every round)
    ids = smol.tokenizer(TEXTS[:1], return_tensors="pt")["input_ids"]
    ref = smol.model.generate(ids, max_new_tokens=8, do_sample=False)
    assistant = tiny_llama(vocab_size=smol.model.config.vocab_size).model
    use_kvdoctor_attention(smol.model)
    # WHEN the main model verifies the drafts on an EngineCache
    out, events, findings = traced(
        smol.model, tmp_path, monkeypatch,
        lambda cache: smol.model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache, assistant_model=assistant))
    # THEN the tokens are greedy decoding's, the crops rollbacks, and the checks find nothing
    assert out.tolist() == ref.tolist()
    assert kinds_of(events)[Rollback]
    assert_clean(findings)


def test_contrastive_search_matches_the_default_cache(smol, tmp_path, monkeypatch):
    ids = smol.tokenizer(TEXTS[:1], return_tensors="pt")["input_ids"]
    ref_ids, ref_logits = contrastive_search(smol.model, ids, DynamicCache(config=smol.model.config), steps=4)
    use_kvdoctor_attention(smol.model)
    (got_ids, got_logits), events, findings = traced(
        smol.model, tmp_path, monkeypatch, lambda cache: contrastive_search(smol.model, ids, cache, steps=4))
    assert got_ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=0)
    assert kinds_of(events)[SeqStart] == 1 + 4 * 2
    assert_clean(findings)
