"""Speculative decoding: the drafters, the acceptance rule, and the scheduler under continuous batching with
rollbacks through the cache; greedy output identical to plain decoding and a clean run free of findings."""

from __future__ import annotations

import random

import pytest
import torch

from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner, SamplingParams, sampling_probs
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.engine.serving.speculative import Draft, DraftRequest, ModelDrafter, NgramDrafter, verify
from kvdoctor.events import Rollback
from kvdoctor.session import Session


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_tail():
    d = NgramDrafter(max_ngram=2)
    req = lambda toks, k: DraftRequest("s", toks, k, SamplingParams())  # noqa: E731
    # the tail (5, 6) occurred before, followed by 7 8 9; the latest earlier occurrence wins
    assert d.propose([req([5, 6, 7, 8, 9, 5, 6, 1, 5, 6], 3)]) == [Draft([1, 5, 6])]
    assert d.propose([req([5, 6, 7, 8, 9, 5, 6], 3)]) == [Draft([7, 8, 9])]
    # nothing repeats: no draft
    assert d.propose([req([1, 2, 3, 4], 3)]) == [Draft([])]


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement_then_the_targets_token():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 9, 1]):
        logits[i, t] = 5.0
    assert verify(logits, Draft([3, 4, 5]), SamplingParams(), None) == ([3, 4, 9], 2)
    assert verify(logits, Draft([3, 4, 9]), SamplingParams(), None) == ([3, 4, 9, 1], 3)
    assert verify(logits[:1], Draft([]), SamplingParams(), None) == ([3], 0)


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_speculative_sampling_keeps_the_target_distribution(drafter):
    # GIVEN the tiny model's next-token distribution p (target) and another tiny model's q (draft)
    params = SamplingParams(greedy=False, temperature=0.5)
    ids = torch.tensor([[5, 17, 42, 9]])
    p_logits = tiny_llama(seed=0).model(ids).logits[0, -1].detach()
    q_logits = tiny_llama(seed=1).model(ids).logits[0, -1].detach()
    p, q = sampling_probs(p_logits, params), sampling_probs(q_logits, params)
    gen = torch.Generator().manual_seed(0)
    logits = torch.stack([p_logits, p_logits])  # (2, V): the bonus position is never reached on rejection
    # WHEN one draft token is drawn from q (or fixed, as prompt lookup proposes) and verified, many times
    n, fixed = 3000, int(q.argmax())
    counts = torch.zeros_like(p)
    for _ in range(n):
        if drafter == "model":
            tok = int(torch.multinomial(q, 1, generator=gen))
            draft = Draft([tok], q[None])
        else:
            draft = Draft([fixed])
        out, _ = verify(logits, draft, params, gen)
        counts[out[0]] += 1
    # THEN the first token is distributed as p (chi-square over the tokens p gives >= 1% and the rest, 99.9%)
    big = (p >= 0.01).nonzero().squeeze(1)
    exp = torch.cat([p[big], (1 - p[big].sum()).reshape(1)]) * n
    obs = torch.cat([counts[big], (n - counts[big].sum()).reshape(1)])
    keep = exp > 5
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert dof >= 3
    assert chi2 < dof + 4.5 * (2 * dof) ** 0.5, (chi2, dof)  # far below for a right rule, far above for q


LM = None


def serve(drafter: str | None, *, fault: str | None = None, prefix_cache: bool = False, greedy: bool = True):
    """Six requests with repetitive prompts (prompt lookup finds drafts) through continuous batching."""
    global LM
    LM = LM or tiny_llama(num_layers=2, max_position_embeddings=512)
    runner = Runner.create(LM.model, block_size=4, device_blocks=48, host_blocks=32, disk_blocks=0, fault=fault,
                           prefix_cache=prefix_cache, stats_every=0)
    session = Session.on_bus(runner.bus)
    events = []
    runner.bus.subscribe(events.extend)
    d = None
    if drafter == "ngram":
        d = NgramDrafter()
    elif drafter == "model":
        draft = tiny_llama(num_layers=1, seed=1)
        d = ModelDrafter(Runner.create(draft.model, block_size=4, device_blocks=64, host_blocks=0, stats_every=0), 128)
    sched = Scheduler(runner, max_batch=4, drafter=d, num_draft=4)
    rng = random.Random(0)
    for r in range(6):
        base = [rng.randrange(3, 128) for _ in range(6)]
        sampling = SamplingParams() if greedy else SamplingParams(greedy=False, seed=r)
        sched.submit(Request(base * 3 + [rng.randrange(3, 128)], max_new_tokens=14, ignore_eos=True, sampling=sampling))
    done = sched.run()
    stats = sched.spec_stats()
    runner.close()
    session.close()
    if d is not None:
        d.close()
    return {s: g.token_ids for s, g in done.items()}, stats, session.findings, events


def test_greedy_speculative_decoding_gives_plain_greedy_tokens_and_a_clean_run():
    plain, _, findings, _ = serve(None)
    assert findings == []
    for drafter, prefix in (("ngram", True), ("model", False)):
        tokens, stats, findings, events = serve(drafter, prefix_cache=prefix)
        assert tokens == plain, drafter
        assert [f.message for f in findings] == []
        assert stats["drafted"] > 0
        if drafter == "ngram":  # repetitive prompts: most lookups are right, more than a token per forward pass
            assert stats["acceptance_rate"] > 0.5 and stats["tokens_per_forward"] > 1.2
            # rejected drafts left the cache through rollbacks, each advancing its sequence's version
            rollbacks = [e for e in events if isinstance(e, Rollback)]
            assert rollbacks and all(e.n >= 1 for e in rollbacks)


def test_sampled_speculative_decoding_runs_clean():
    _, stats, findings, _ = serve("ngram", greedy=False)
    assert [f.message for f in findings] == [] and stats["drafted"] > 0


def test_a_rollback_that_does_not_cut_the_length_is_caught_naming_sequence_and_block():
    _, _, findings, events = serve("ngram", fault="spec-rollback-uncut")
    # one finding for the cause, at the first sequence off its position; the later rows and writes in its cascade
    (f,) = [f for f in findings if f.rule in ("batch-position", "write-position")]
    rolled = {e.seq for e in events if isinstance(e, Rollback)}
    assert f.seq in rolled and f.step is not None
    assert "batch/write-position" in f.evidence["cascade"]["rules"]
    assert set(f.evidence["cascade"]["sequences"]) <= rolled


def test_num_draft_must_be_positive():
    with pytest.raises(ValueError, match="num_draft=0"):
        Scheduler.__init__(object.__new__(Scheduler), None, num_draft=0)  # type: ignore[arg-type]
