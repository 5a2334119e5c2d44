"""The runner against transformers' own generate on a tiny random Llama: same tokens, same logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvdoctor.engine.features.protocol import Step, StepFeature
from kvdoctor.engine.model.attention import attend
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner, SamplingParams, UnsupportedModel, sample
from kvdoctor.events import Batch, Read, Write, attn_rows

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]


@pytest.fixture(scope="module")
def model():
    return tiny_llama().model


def _reference(model, prompt, n=16):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def _events(runner):
    seen = []
    runner.bus.subscribe(seen.extend)
    return seen


@pytest.mark.parametrize("listening", [False, True])
def test_greedy_tokens_and_logits_match_generate(model, listening):
    # GIVEN a runner over a small paged cache (blocks of 4), with or without a listener (fused vs explicit attention)
    refs = [_reference(model, p) for p in PROMPTS]
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        if listening:
            _events(runner)
        # WHEN all prompts are generated together with continuous batching
        gens = runner.generate(PROMPTS, max_new_tokens=16, keep_logits=True)
    # THEN every row's tokens equal transformers' batch-1 greedy output, and the logits agree
    for (tokens, logits), gen in zip(refs, gens):
        assert gen.token_ids == tokens[: len(gen.token_ids)]
        assert gen.finish_reason == ("stop" if len(gen.token_ids) < 16 else "length")
        torch.testing.assert_close(torch.stack(gen.logits), logits[: len(gen.logits)], atol=1e-4, rtol=0)


def test_every_step_emits_batch_write_read_and_attn(model):
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        seen = _events(runner)
        runner.generate(PROMPTS[:2], max_new_tokens=5)
        runner.bus.flush()
    batches = [e for e in seen if isinstance(e, Batch)]
    # THEN each step's batch lists its rows at their current lengths, shaped (rows, H_kv, T, D)
    assert batches[0].rows == [0, 1] and batches[0].positions == [0, 0] and batches[0].n == [7, 2]
    assert batches[1].positions == [7, 2] and batches[1].n == [1, 1] and batches[1].shape == [2, 2, 8, 16]
    kinds = Counter(type(e) for e in seen)
    # 5 steps x 2 rows: one read per row and step, one attn event per row, layer (2) and step
    assert kinds[Read] == 10
    assert len(attn_rows(seen)) == 20
    writes = [e for e in seen if isinstance(e, Write) and e.seq == 0]
    assert [(w.pos, w.n) for w in writes[:3]] == [(0, 4), (4, 3), (7, 1)]
    assert all(isinstance(e.entropy, float) and e.nonfinite == 0 for e in attn_rows(seen))


def test_stats_every_n_steps(model):
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, stats_every=3) as runner:
        seen = _events(runner)
        runner.generate([PROMPTS[0]], max_new_tokens=7)
        runner.bus.flush()
    steps = sorted({e.step for e in attn_rows(seen)})
    assert steps == [0, 3, 6]


def test_attention_nan_fault_shows_as_nonfinite_stats(model):
    # GIVEN the attention-nan fault
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, fault="attention-nan") as runner:
        seen = _events(runner)
        runner.generate([PROMPTS[0]], max_new_tokens=4)
        runner.bus.flush()
    # THEN from step 2 on the middle layer reports non-finite scores
    bad = {(e.step, e.layer) for e in attn_rows(seen) if e.nonfinite}
    assert bad and all(step >= 2 and layer == 1 for step, layer in bad)


def test_forward_rejects_a_row_listed_twice(model):
    with Runner.create(model, block_size=4, device_blocks=8, host_blocks=0) as runner:
        runner.cache.add_sequence("a", prompt_len=2)
        with pytest.raises(ValueError, match="twice"):
            runner.forward([("a", [1, 2]), ("a", [3])])


def test_sampling_is_reproducible_with_a_seed(model):
    params = SamplingParams(greedy=False, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        a = runner.generate([PROMPTS[0]], max_new_tokens=10, sampling=params)[0].token_ids
        b = runner.generate([PROMPTS[0]], max_new_tokens=10, sampling=params)[0].token_ids
    assert a == b and len(a) >= 1


def test_top_k_1_sampling_is_greedy():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, SamplingParams(greedy=False, top_k=1), g) == 1 for _ in range(5))
    assert sample(logits, SamplingParams(greedy=False, top_p=0.01), g) == 1


def test_unsupported_models_are_refused_with_a_reason():
    class NotLlama(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    with pytest.raises(UnsupportedModel, match="gpt2"):
        Runner(NotLlama(), cache=None)


def test_sampling_survives_nan_logits():
    # GIVEN logits corrupted by NaN (the attention-nan fault), WHEN sampling, THEN the engine keeps going
    params = SamplingParams(greedy=False, seed=0)
    g = torch.Generator().manual_seed(0)
    assert sample(torch.tensor([float("nan"), 1.0, float("nan")]), params, g) == 1
    assert isinstance(sample(torch.full((4,), float("nan")), params, g), int)


class _Probe(StepFeature):
    """A step feature that records when the runner calls it."""

    def __init__(self, changes_attention: bool) -> None:
        self.changes_attention = changes_attention
        self.calls: list[tuple] = []

    def begin_step(self, step: Step) -> None:
        self.calls.append(("begin", tuple(step.seqs)))

    def after_store(self, layer: int, seqs) -> None:
        self.calls.append(("store", layer))

    def after_commit(self, step: Step) -> None:
        self.calls.append(("commit", tuple(step.seqs)))


@pytest.mark.parametrize("changes_attention", [False, True])
def test_a_step_feature_plugs_in_and_decides_the_compiled_path(model, monkeypatch, changes_attention):
    # GIVEN a runner with its compiled decode layers, and a new feature added to its features
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "1")
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        if runner._decode is None:
            pytest.skip("no compiled decode layers here (no C compiler, or not torch's OpenMP runtime)")
        probe = _Probe(changes_attention)
        runner._features.append(probe)
        compiled = []
        decode_step = runner._decode_step
        runner._decode_step = lambda *a: compiled.append(decode_step(*a)) or compiled[-1]
        # WHEN a prompt is prefilled and then decoded for two steps
        runner.generate([PROMPTS[0]], max_new_tokens=3)
    # THEN the feature is told of every step, and of each layer's store wherever the torch path ran
    stores = [("store", layer) for layer in range(runner.num_layers)]
    decode = [("begin", (0,))] + ([] if not changes_attention else stores) + [("commit", (0,))]
    assert probe.calls == [("begin", (0,)), *stores, ("commit", (0,))] + decode * 2
    # AND the compiled layers ran exactly on the decode steps when it leaves attention alone
    assert [c is not None for c in compiled] == [False] + [not changes_attention] * 2


class _Taker(StepFeature):
    """A step feature that changes attention through the hooks: the group's own mask, dense attention of its own
    on layer 1 (the runner's on layer 0), and the first block of each row as what was read."""

    changes_attention = True

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def begin_step(self, step: Step) -> None:
        self.plan = step.plan

    def layout(self, layer, group):
        self.calls["layout", layer] += 1
        return group.layout

    def attend(self, layer, q, group, scale):
        self.calls["attend", layer] += 1
        if layer == 0:
            return None
        k, v = self.plan.gather(layer, group.blocks, group.kv_len, q.dtype)  # (B, H_kv, T, D) each
        return attend(q, k, v, group.layout, scale=scale, scores=True)

    def read_ids(self, seq, ids):
        return list(ids[:1])


def test_a_feature_changes_attention_through_the_protocol_hooks(model):
    # GIVEN a runner, and one with a feature that takes layer 1's attention over and names one block per row read
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        _events(runner)
        ref = runner.generate(PROMPTS, max_new_tokens=4)
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        taker = _Taker()
        runner._features.append(taker)
        seen = _events(runner)
        # WHEN the prompts are generated
        out = runner.generate(PROMPTS, max_new_tokens=4)
    # THEN its attention (dense over the same blocks) gives the runner's own tokens
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]
    # AND it took every group over on layer 1, and gave the mask of every group the runner attended on layer 0
    assert taker.calls["attend", 0] == taker.calls["attend", 1] > 0
    assert taker.calls["layout", 0] >= taker.calls["attend", 0]
    # AND every read event lists the one block it named
    reads = [e for e in seen if isinstance(e, Read)]
    assert reads and all(len(e.blocks) == 1 for e in reads)
