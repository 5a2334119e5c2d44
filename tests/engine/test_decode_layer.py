"""The compiled decode layers: what the runner's torch path computes, on the steps where they apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdoctor.engine.kernels import pool
from kvdoctor.engine.model.attention import Newest, layer_stats
from kvdoctor.engine.model.decode_layer import DecodeLayers
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.events import Read, attn_rows

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40)), [9] * 13]  # different lengths: hidden keys


def _runner(model, compiled: bool, monkeypatch, **config) -> Runner:
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "1" if compiled else "0")
    runner = Runner.create(model, block_size=4, device_blocks=96, host_blocks=0, **config)
    if compiled and runner._decode is None:
        pytest.skip("no compiled decode layers here (no C compiler)")
    assert (runner._decode is not None) == compiled
    return runner


def _run(model, compiled: bool, monkeypatch, **config):
    """Every prompt decoded greedily together, with the attention statistics of every step; and how many
    steps took the compiled layers."""
    events: list = []
    with _runner(model, compiled, monkeypatch, **config) as runner:
        runner.bus.subscribe(events.extend)
        used = []
        step = runner._decode_step
        runner._decode_step = lambda *a: used.append(step(*a)) or used[-1]
        outs = runner.generate(PROMPTS, max_new_tokens=10, keep_logits=True)
    attn = {(e.step, e.seq, e.layer): e for e in attn_rows(events)}
    return outs, attn, sum(u is not None for u in used)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_give_the_torch_paths_tokens_logits_and_statistics(monkeypatch, dtype):
    # GIVEN a random Llama and four prompts of different lengths decoded together (padded rows, hidden keys,
    # K/V crossing blocks of 4), with the attention statistics every step
    model = tiny_llama(hidden_size=128, intermediate_size=256, dtype=dtype).model
    # WHEN they are decoded by the runner's torch path, then with the compiled layers
    want, want_attn, none = _run(model, False, monkeypatch)
    got, got_attn, used = _run(model, True, monkeypatch)
    # THEN the compiled layers ran every decode step (and not the prefill), the torch path none
    assert none == 0 and used == 9
    # AND the tokens are the same and the logits agree: to float32's last bits, or to bf16's rounding
    tol = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), atol=tol, rtol=0)
    # AND every row's attention statistics of every layer are the same (the scores attention used)
    assert want_attn.keys() == got_attn.keys() and len(got_attn) == 10 * 4 * 2
    for key, a in want_attn.items():
        b = got_attn[key]
        assert b.nonfinite == a.nonfinite == 0
        for field in ("max_logit", "entropy", "sink"):
            assert getattr(b, field) == pytest.approx(getattr(a, field), abs=1e-4 if dtype == "float32" else 0.03), (key, field)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_layers_give_the_same_logits_bit_for_bit_whatever_the_pools_team_and_spin(monkeypatch, dtype):
    # GIVEN a random Llama whose every loop of a step is shared (rows, attention's (row, kv head) pairs, products)
    model = tiny_llama(hidden_size=512, intermediate_size=512, num_heads=8, dtype=dtype).model
    outs = []
    try:
        # WHEN the prompts are decoded on teams of 1, 2 and 3 (more than the CPUs: shares a worker never starts
        # are the caller's), spinning long or sleeping at once
        for team, spin in ((1, pool.SPIN_US), (2, pool.SPIN_US), (2, 0), (3, 0)):
            pool.configure(team, spin)
            outs.append(_run(model, True, monkeypatch)[0])
    finally:
        pool.configure(None, pool.SPIN_US)
    # THEN every token and every logit is the same, to the bit
    for got in outs[1:]:
        for a, b in zip(outs[0], got):
            assert a.token_ids == b.token_ids and torch.equal(torch.stack(a.logits), torch.stack(b.logits))


def _keep(d) -> None:
    st = d.stats
    d.stats = type(st)(*(t.clone() for t in (st.summary, st.heads_entropy, st.heads_max_logit)))
    d.shares = d.shares.copy()


@pytest.mark.parametrize("poison", [False, True])
def test_statistics_and_digest_sums_taken_inside_agree_with_the_kernels_over_the_same_buffers(monkeypatch, poison):
    # GIVEN the compiled layers keeping every layer's scores and probabilities, with per-head statistics,
    # while digests are recorded; poisoned: from the third decode step the first layer's stored K/V are NaN
    # (every score but the new token's is then NaN: the heads the exact pass redoes)
    model = tiny_llama(hidden_size=128, intermediate_size=256).model
    steps = []
    with _runner(model, True, monkeypatch, per_head=True) as runner:
        layout = runner.cache.digests.layouts[runner.cache.codec.name]
        runner.bus.subscribe(lambda events: None)
        step = runner._decode_step

        def kept(plan, groups, lens, slots, hooks, keep, stats):
            if poison and len(steps) == 3:
                runner.cache.layer_kv(0).fill_(float("nan"))
            steps.append(d := step(plan, groups, lens, slots, hooks, True, stats))
            if d is not None:  # the statistics and shares buffers serve the next step too: kept as they were
                run = d.run
                d.run = lambda *a: (run(*a), _keep(d))[0]
            return d
        runner._decode_step = kept
        runner.generate(PROMPTS, max_new_tokens=6)
    # WHEN the statistics kernel reads each step's kept scores, probabilities and row lengths afterwards
    steps = [d for d in steps if d is not None]
    assert len(steps) == 5
    # (poisoned, the last steps count non-finite scores)
    assert [bool(d.stats.summary[..., 3].any()) for d in steps] == [poison and i >= 2 for i in range(5)]
    for d in steps:
        keep = torch.arange(d.T)[None] < d.lens[:, None].long()
        want = layer_stats([Newest(n[0], n[1]) for n in d.newest], keep, sink_tokens=4, per_head=True)
        # THEN the statistics taken inside attention, each head's included, are theirs: the largest scores and
        # the counts to the bit, entropy and sink mass to float32's rounding (taken from the softmax's sums
        # in its own pass, not from the probabilities afterwards)
        got = d.stats
        assert torch.equal(got.summary[..., [0, 3]], want.summary[..., [0, 3]])
        assert torch.equal(got.heads_max_logit, want.heads_max_logit)
        torch.testing.assert_close(got.summary[..., 1:3], want.summary[..., 1:3], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.heads_entropy, want.heads_entropy, rtol=1e-5, atol=1e-5)
        # AND the digest unit sums of the new K/V are the cache's own sums of them
        H, H_kv, D = 4, 2, 32
        k, v = (d.qkv[..., (H + c * H_kv) * D: (H + (c + 1) * H_kv) * D].unflatten(-1, (H_kv, D)) for c in (0, 1))
        assert (d.units == layout.kv_units(k, v)).all()
        # AND each token's share of a record's digest at every column is its units weighted by the digest's
        mix = d._weights[2]
        want_shares = (d.units.T[:, :, None] * mix[None]).sum(axis=1)  # (M, U), numpy wrapping as uint64 does
        assert (d.shares == want_shares.astype(np.uint64)).all()


def test_steps_with_the_attention_nan_faults_hook_take_the_torch_path(monkeypatch):
    # GIVEN the attention-nan fault (on the middle layer, 1 of 2, from step 2)
    model = tiny_llama(hidden_size=128, intermediate_size=256).model
    events: list = []
    with _runner(model, True, monkeypatch, fault="attention-nan") as runner:
        runner.bus.subscribe(events.extend)
        runner.generate(PROMPTS[:2], max_new_tokens=6)
    # THEN the corrupted scores reach the statistics of that layer, as on the torch path
    bad = {(e.layer, e.step) for e in attn_rows(events) if e.nonfinite}
    assert bad and all(layer == 1 and step >= 2 for layer, step in bad)


def test_the_compiled_layers_apply_only_to_plain_llama_layers(monkeypatch):
    # GIVEN models the C layers do not compute: a bias on q/k/v, an activation other than SiLU
    model = tiny_llama(hidden_size=128, intermediate_size=256).model
    layers = list(model.model.layers)
    with _runner(model, True, monkeypatch) as runner:
        assert DecodeLayers.for_model(model, layers, runner._weights) is not None
        gelu = torch.nn.GELU()
        saved, layers[1].mlp.act_fn = layers[1].mlp.act_fn, gelu
        try:
            # THEN they are not used for the model
            assert DecodeLayers.for_model(model, layers, runner._weights) is None
        finally:
            layers[1].mlp.act_fn = saved
    # AND a switched-off environment (KVDOCTOR_DECODE_LAYER=0) leaves the torch path
    monkeypatch.setenv("KVDOCTOR_DECODE_LAYER", "0")
    assert DecodeLayers.for_model(model, layers, runner._weights) is None


@pytest.mark.parametrize("verify", ["full", "sample"])
@pytest.mark.parametrize("fault", [None, "bit-flip"])
def test_kv_the_compiled_layers_store_is_verified_like_any_other(monkeypatch, tmp_path, fault, verify):
    # GIVEN a traced run whose decode steps store K/V from the compiled layers (the cache's direct-store rows),
    # with or without a bit flipped in a block after a write, every read verified against the blocks' digests
    # (full), or swept at N = 1 (every block of every read due each read: attention takes their digests as it
    # reads them)
    from tests.engine.engine_support import findings_of

    model = tiny_llama(hidden_size=128, intermediate_size=256).model
    path = tmp_path / "run.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    with _runner(model, True, monkeypatch, verify=verify, verify_every=1, fault=fault) as runner:
        direct, looked = [], []
        rows, verify_again = runner.cache.store_rows, runner.cache.mover.verify
        runner.cache.store_rows = lambda slots: direct.append(rows(slots)) or direct[-1]
        runner.cache.mover.verify = lambda blocks: looked.append(len(blocks)) or verify_again(blocks)
        runner.generate(PROMPTS, max_new_tokens=8)
    monkeypatch.delenv("KVDOCTOR_TRACE")
    _, events, findings = findings_of(path)
    # THEN the decode steps stored directly, and a clean run gives no finding at all
    assert len(direct) == 7 and all(r is not None for r in direct)
    if fault is None:
        assert findings == []
        # AND swept, the sweep's bound holds on the compiled layers: at N = 1 every block of every decode read
        # carried its digest, taken by attention, but a block first written in that step (it has no record
        # until the step commits: its first verification is the next read's); only the prefill's reads (the
        # torch path; a sequence's first read verifies every block it holds) were verified by a pass afterwards
        if verify == "sample":
            reads = [e for e in events if isinstance(e, Read)]
            prefill = [e for e in reads if e.step == 0]
            decode = [(e, next(p for p in reversed(reads[:i]) if p.seq == e.seq)) for i, e in enumerate(reads)
                      if e.step > 0]
            assert len(decode) == 7 * len(PROMPTS)
            assert all((d is None) == (b not in before.blocks) for e, before in decode
                       for b, d in zip(e.blocks, e.digests))
            assert looked == [len(e.blocks) for e in prefill]
            assert all(d is not None for e in prefill for d in e.digests)
    else:  # AND the flipped bit is found by the digests, as for K/V the cache stored itself
        assert [f.check for f in findings] == ["integrity"] and "bytes changed without a write" in findings[0].message


def test_the_sweeps_bound_holds_on_the_compiled_layers_for_rows_longer_than_n_blocks(monkeypatch):
    # GIVEN rows of 12 to 20 blocks of 4 tokens decoded by the compiled layers under the sweep at N = 4: each
    # row earns 3 to 5 verifications a read, more than the one a row attention verified before
    n = 4
    model = tiny_llama(hidden_size=128, intermediate_size=256).model
    prompts = [list(range(3, 51)), list(range(7, 83)), [9] * 60]
    events: list = []
    with _runner(model, True, monkeypatch, verify="sample", verify_every=n) as runner:
        runner.bus.subscribe(events.extend)
        used = []
        step = runner._decode_step
        runner._decode_step = lambda *a: used.append(step(*a)) or used[-1]
        runner.generate(prompts, max_new_tokens=20)
    assert sum(u is not None for u in used) == 19  # every decode step compiled
    # THEN no block a row read went N of its reads without a verification, to the last read
    reads: dict = {}
    for e in events:
        if isinstance(e, Read):
            reads.setdefault(e.seq, []).append(e)
    for seq, rs in reads.items():
        last: dict[int, int] = {}
        for r, e in enumerate(rs):
            for b, d in zip(e.blocks, e.digests or [None] * len(e.blocks)):
                assert r - last.setdefault(b, r) <= n, (seq, b, r)
                if d is not None:
                    last[b] = r
        assert all(len(rs) - 1 - at < n for at in last.values())
