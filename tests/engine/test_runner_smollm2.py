"""SmolLM2-135M-Instruct through the engine: transformers' greedy tokens, 128 at a time, on every path.

One slow module (it loads the embedded model once): the runner at batch 1 and with a
batch of four prompts of different lengths, the same batch through a device tier so
small that sequences are swapped to host and disk while decoding, and ``generate``
on ``EngineCache`` at batch 1 and with a left-padded batch of four. Logits are fp32
and must agree with transformers' to 1e-4.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from kvdoctor.engine.model.hf import EngineCache, use_kvdoctor_attention
from kvdoctor.engine.model.model import convert_embedded, converted_dir, verify_copy
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.events import SwapIn, SwapOut, attn_rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

NEW = 128
TEXTS = [
    "The three primary colors are",
    "Write a short story about a robot who learns to paint. Once upon a time,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who had never "
    "left the harbour. Every morning he mended his nets and watched the boats go out, and one day",
]


@pytest.fixture(scope="module")
def prompts(smol):
    return [smol.tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def references(smol, prompts):
    """transformers' own greedy generate with its default cache, batch 1, per prompt."""
    out = []
    for p in prompts:
        r = smol.model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        out.append((r.sequences[0, len(p):].tolist(), torch.stack(r.logits)[:, 0]))
    # Prompts that end at once would prove little: every one runs for most of the 128 tokens.
    assert all(len(tokens) >= 96 for tokens, _ in out), [len(t) for t, _ in out]
    return out


def _check(gen_tokens, gen_logits, ref):
    tokens, logits = ref
    assert gen_tokens == tokens
    if gen_logits is not None:
        torch.testing.assert_close(gen_logits, logits, atol=1e-4, rtol=0)


def test_runner_batch1_matches_generate(smol, prompts, references):
    with Runner.create(smol.model, tokenizer=smol.tokenizer) as runner:
        runner.bus.subscribe(lambda evs: None)  # listening: attention with statistics
        for p, ref in zip(prompts[:3], references[:3]):
            gen = runner.generate([p], max_new_tokens=NEW, keep_logits=True)[0]
            _check(gen.token_ids, torch.stack(gen.logits), ref)


def test_runner_batch4_of_different_lengths_matches_generate(smol, prompts, references):
    assert len({len(p) for p in prompts}) == 4
    with Runner.create(smol.model, tokenizer=smol.tokenizer) as runner:
        gens = runner.generate(prompts, max_new_tokens=NEW, keep_logits=True)
    for gen, ref in zip(gens, references):
        _check(gen.token_ids, torch.stack(gen.logits), ref)


def test_runner_batch4_through_a_tiny_device_tier_swaps_and_matches(smol, prompts, references):
    # GIVEN a device tier of 24 blocks for ~42 blocks of work, a 12-block host and a disk tier
    with Runner.create(smol.model, tokenizer=smol.tokenizer, block_size=16, device_blocks=24, host_blocks=12,
                       disk_blocks=128) as runner:
        seen = []
        runner.bus.subscribe(seen.extend)
        sched = Scheduler(runner, keep_logits=True)
        seqs = [sched.submit(Request(p, max_new_tokens=NEW, priority=i)) for i, p in enumerate(prompts)]
        done = sched.run()
    # THEN sequences were swapped out to host and disk and back while decoding
    moves = Counter((e.src, e.dst) for e in seen if isinstance(e, (SwapOut, SwapIn)))
    assert moves[("device", "host")] and moves[("device", "disk")], moves
    assert moves[("host", "device")] and moves[("disk", "device")], moves
    # AND every token and logit is still transformers'
    for seq, ref in zip(seqs, references):
        _check(done[seq].token_ids, torch.stack(done[seq].logits), ref)


def test_generate_on_engine_cache_batch1_matches(smol, prompts, references):
    model = smol.model
    use_kvdoctor_attention(model)
    try:
        for p, ref in zip(prompts[:3], references[:3]):
            with EngineCache(model, device_blocks=64, host_blocks=0) as cache:
                seen = []
                cache.bus.subscribe(seen.extend)
                r = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, cache=cache,
                                   output_logits=True, return_dict_in_generate=True)
            _check(r.sequences[0, len(p):].tolist(), torch.stack(r.logits)[:, 0], ref)
            assert len(attn_rows(seen)) == 30 * len(r.logits)
    finally:
        model.set_attn_implementation("sdpa")


def test_generate_on_engine_cache_padded_batch4_matches_default_cache(smol, prompts):
    model, tok = smol.model, smol.tokenizer
    tok.padding_side = "left"
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**batch, **kwargs)
    with EngineCache(model, device_blocks=128, host_blocks=0) as cache:
        out = model.generate(**batch, cache=cache, **kwargs)
    assert out.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=0)


def test_a_damaged_converted_copy_is_rebuilt(smol, tmp_path, monkeypatch):
    # GIVEN the converted copy, copied under another cache home, with one weight byte flipped
    src = converted_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dst = converted_dir()
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.seek(weights.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert "CRC-32" in verify_copy(dst)
    # WHEN it is asked for, THEN it is rebuilt from the GGUF and verifies again
    assert convert_embedded() == dst
    assert verify_copy(dst) is None
