"""Content digests: the engine's record of what it meant to write, checked against the bytes it holds.

Cache-level tests drive the tiny cache of ``engine_support`` by hand (forks, rollbacks, swaps
through host and disk, re-encodes); model-level tests run a tiny random Llama through the
runner and scheduler, clean with every codec and with each content fault switched on.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_support import Recorder, tiny_config
from kvdoctor.checks import make_suite
from kvdoctor.engine.kv import digest
from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.kv.codecs import Calibration, calibrate, calibration_windows
from kvdoctor.engine.faults import CONTENT_FAULTS
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner, SamplingParams
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.events import Read, Write

CAL = Calibration(torch.full((2, 2, 8), 5.0), 1, 1, "constant 5")


def checked(**kw) -> tuple[Recorder, object]:
    kw.setdefault("calibration", CAL)
    rec = Recorder(PagedKVCache(tiny_config(**kw)))
    suite = make_suite()
    rec.cache.bus.subscribe(suite.observe_many)
    return rec, suite


def findings(rec: Recorder, suite) -> list[str]:
    rec.cache.close()
    suite.finish()
    return [f"{f.check}/{f.rule}: {f.message}" for f in suite.findings]


@pytest.mark.parametrize("codec", [None, "fp16", "nf4", "int8", "device=fp32,host=int8,disk=nf4", "mixed"])
def test_digests_follow_the_bytes_through_forks_rollbacks_swaps_and_re_encodes(codec, tmp_path):
    # GIVEN every read verified, and a cache where blocks fork, roll back, and go down to disk and back
    rec, suite = checked(codec=codec, verify="full", device_blocks=6, host_blocks=3, disk_blocks=8,
                         disk_dir=str(tmp_path), mixed_window=1, mixed_high_fraction=0.0)
    cache = rec.cache
    rec.add("a", 6)
    rec.fork("a", "b")
    rec.write("b", 3)  # copy-on-write of the shared tail
    rec.rollback("a", 1)
    rec.write("a", 3)  # rewrites a rolled-back row
    cache.emit_read("a")
    cache.emit_read("b")
    cache.end_step()
    cache.swap_out(cache.block_table("a"), dst="host")
    cache.swap_out(cache.block_table("a")[:1], dst="disk")
    rec.add("c", 9)  # pushes blocks of b down
    cache.ensure_resident(["a"])
    cache.emit_read("a")
    rec.write("a", 1)
    cache.emit_read("a")
    cache.end_step()
    if codec is None:
        rec.assert_intact("a")  # lossless: the very bytes written
    # THEN every write carried a digest, every read verified every block, and the digests agree
    reads = rec.kinds("read")
    assert all(w.digest is not None for w in rec.kinds("write"))
    assert reads and all(d is not None for r in reads for d in r.digests)
    assert findings(rec, suite) == []


@pytest.mark.parametrize("codec", [None, "int8", "nf4", "mixed"])
def test_a_long_prefill_summed_at_once_gives_the_digests_a_decode_would(codec, tmp_path):
    # GIVEN a prompt longer than what is held until commit (its sums are taken layer by layer at store)
    rec, suite = checked(codec=codec, verify="full", device_blocks=40, disk_dir=str(tmp_path))
    rec.add("a", 70)
    rec.write("a", 1)
    rec.cache.emit_read("a")
    # THEN every block has a digest, and the read finds the bytes the writes recorded
    assert all(w.digest is not None for w in rec.kinds("write"))
    assert findings(rec, suite) == []


def test_a_read_digest_is_the_write_digest_of_the_same_bytes(make_cache):
    rec = make_cache(verify="full")
    rec.add("a", 3)
    rec.cache.emit_read("a")
    (w,), (r,) = rec.kinds("write"), rec.kinds("read")
    assert r.digests == [w.digest] and r.digest_layers is None
    # a different row order of the same tokens is a different digest
    rec2 = make_cache(verify="full")
    rec2.cache.add_sequence("a", prompt_len=3)
    slots = rec2.cache.reserve("a", 3)
    for layer in range(2):
        k, v = rec.kv["a"][layer]
        rec2.cache.store(layer, slots, k.flip(0), v.flip(0))
    rec2.cache.commit("a")
    assert rec2.kinds("write")[0].digest != w.digest


@settings(max_examples=40, deadline=None)
@given(codec=st.sampled_from([None, "fp16", "bf16", "int8", "nf4"]), layer=st.integers(0, 1), head=st.integers(0, 1),
       pos=st.integers(0, 2), element=st.integers(0, 3), bit=st.integers(0, 7))
def test_any_flipped_bit_of_a_written_value_is_found_at_its_layer(tmp_path_factory, codec, layer, head, pos, element, bit):
    # GIVEN a block holding three written tokens under any codec
    rec = Recorder(PagedKVCache(tiny_config(codec=codec, calibration=CAL, verify="full",
                                            disk_dir=str(tmp_path_factory.mktemp("d")))))
    rec.add("a", 3)
    cache = rec.cache
    blk = cache.seqs["a"].blocks[0]
    # WHEN one bit of one byte of token ``pos``'s V flips where it is stored
    c = cache.codecs[blk.codec]
    if c.native:
        start = (c.block_size + pos) * c.head_dim * c.arena_dtype.itemsize  # V follows the block's K
    else:
        width = c._regions["v"][1] // c.block_size
        start = c._regions["v"][0] + pos * width
    cache.fault_hooks.raw(blk)[layer, head].view(torch.uint8)[start + element] ^= 1 << bit
    cache.emit_read("a")
    # THEN the read's digest differs from the write's, and the first differing layer is the one hit
    (w,), (r,) = rec.kinds("write"), rec.kinds("read")
    assert r.digests[0] != w.digest and r.digest_layers == [layer]
    cache.close()


def _digests_of_a_run(tmp_path, codec, strided):
    """Write and read digests of a fixed run: prefill, decode, a long prefill, a swap round trip."""
    rec = Recorder(PagedKVCache(tiny_config(codec=codec, calibration=CAL, verify="full", disk_dir=str(tmp_path),
                                            device_blocks=24)))
    c, cache = rec.cache.config, rec.cache
    if strided:  # K and V as the runner hands them: views into one wider projection output per token
        store = cache.store

        def store_views(layer, slots, k, v):
            wide = torch.cat([k, v, torch.full_like(k, 7.0)], dim=1)  # (N, 3 H, D)
            store(layer, slots, wide[:, : c.num_kv_heads], wide[:, c.num_kv_heads: 2 * c.num_kv_heads])
        cache.store = store_views
    rec.add("a", 3)
    for _ in range(3):
        rec.write("a", 1)
    rec.add("b", 70)  # summed at store, not held to commit
    cache.emit_read("a")
    cache.swap_out(cache.block_table("a")[:1], dst="host")
    cache.ensure_resident(["a"])
    cache.emit_read("a")
    cache.bus.flush()
    digests = [(type(e).__name__, getattr(e, "digest", None), getattr(e, "digests", None)) for e in rec.events
               if hasattr(e, "digest") or hasattr(e, "digests")]
    cache.close()
    return digests


@pytest.mark.skipif(digest._sums_kernel() is None, reason="the digest kernel does not build here")
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "views"])
@pytest.mark.parametrize("codec", [None, "fp16", "bf16", "int8", "nf4"])
def test_the_compiled_unit_sums_give_numpys_digests(tmp_path, monkeypatch, codec, strided):
    # GIVEN the same run with the compiled unit sums and with numpy's einsum
    compiled = _digests_of_a_run(tmp_path, codec, strided)
    monkeypatch.setattr(digest, "_sums_kernel", lambda: None)
    reference = _digests_of_a_run(tmp_path, codec, strided)
    # THEN every write, read and swap carries the same digest, and there were digests to compare
    assert compiled == reference
    assert sum(d is not None for _, d, _ in compiled) >= 5 and any(ds for _, _, ds in compiled)


def _verified(rec: Recorder) -> list[list[tuple[object, int]]]:
    """Per read event: the (sequence, block id) it verified."""
    return [[(r.seq, b) for b, d in zip(r.blocks, r.digests or ()) if d is not None] for r in rec.kinds("read")]


def _gaps(rec: Recorder, reads_per_step: int) -> dict[tuple[object, int], int]:
    """Per (sequence, block): the most steps between two of its verifications (the first read counts as one),
    to the last step read."""
    last: dict[tuple[object, int], int] = {}
    worst: dict[tuple[object, int], int] = {}
    events = _verified(rec)
    for n, picks in enumerate(events):
        step = n // reads_per_step
        for key in picks:
            worst[key] = max(worst.get(key, 0), step - last.get(key, 0))
            last[key] = step
    end = (len(events) - 1) // reads_per_step
    return {key: max(worst[key], end - last[key]) for key in worst}


def test_the_sweep_verifies_a_first_read_whole_then_the_blocks_in_turn_at_their_share_of_n(make_cache):
    # GIVEN the sweep with N = 6 and a sequence of three blocks, read seven times
    rec = make_cache(verify="sample", verify_every=6, device_blocks=8)
    rec.add("a", 12)
    ids = [b.id for b in rec.cache.seqs["a"].blocks]
    for _ in range(7):
        rec.cache.emit_read("a")
    first, *rest = _verified(rec)
    # THEN its first read verifies every block it holds, and after it one read in two (3 blocks / 6) verifies
    # one block, the one verified longest ago: each block in turn
    assert first == [("a", b) for b in ids]
    assert [len(v) for v in rest] in ([1, 0] * 3, [0, 1] * 3)
    assert [v[0][1] for v in rest if v] == ids


@pytest.mark.parametrize("num_blocks", [3, 40])
def test_every_block_of_every_row_is_verified_within_n_steps_whatever_its_length(make_cache, num_blocks):
    # GIVEN a batch of 8 sequences read once a step with N = 8, short (3 blocks) or longer than N (40 blocks)
    n = 8
    rec = make_cache(verify="sample", verify_every=n, device_blocks=8 * num_blocks)
    names = [f"s{i}" for i in range(8)]
    for name in names:
        rec.add(name, 4 * num_blocks)
    steps = 5 * n
    for _ in range(steps):
        for name in names:
            rec.cache.emit_read(name)
    # THEN no block of any row went more than N steps unverified, and the sweep verified about blocks / N a
    # step after the first (one a row a step at most for the short ones: what the compiled layers verify)
    gaps = _gaps(rec, len(names))
    assert len(gaps) == 8 * num_blocks and max(gaps.values()) <= n
    per_step = [sum(map(len, _verified(rec)[s * 8: s * 8 + 8])) for s in range(1, steps)]
    assert sum(per_step) <= (steps - 1) * 8 * num_blocks / n + 8
    if num_blocks < n:
        assert all(len(v) <= 1 for v in _verified(rec)[8:])


def test_a_block_never_verified_is_verified_on_its_first_read_without_waiting_its_turn(make_cache):
    # GIVEN a sequence read once (its blocks verified), with a large N, then given a new block
    rec = make_cache(verify="sample", verify_every=1000, device_blocks=8)
    rec.add("a", 8)
    rec.cache.emit_read("a")
    rec.write("a", 1)
    new = rec.cache.seqs["a"].blocks[-1].id
    for _ in range(10):
        rec.cache.emit_read("a")
    # THEN the read after the write verifies the new block (a fresh slot: the likeliest to hold wrong bytes),
    # and of the next ten at most one verifies anything (credit for one block in 333 reads)
    after = _verified(rec)[1:]
    assert ("a", new) in after[0] and sum(map(len, after[1:])) <= 1


def test_the_sweep_finds_a_corrupt_block_within_n_reads(make_cache):
    rec = make_cache(verify="sample", verify_every=4, device_blocks=8)
    suite = make_suite()
    rec.cache.bus.subscribe(suite.observe_many)
    rec.add("a", 12)
    rec.cache.emit_read("a")  # the first read: every block verified, clean
    blk = rec.cache.seqs["a"].blocks[2]
    rec.cache.fault_hooks.raw(blk)[1, 0, 5] += 1.0  # one element of layer 1 changes under the cache
    for _ in range(4):  # the bound: N reads
        rec.cache.emit_read("a")
    rec.cache.bus.flush()
    [f] = suite.findings
    assert (f.rule, f.block, f.seq, f.layer) == ("read-mismatch", blk.id, "a", 1)


def test_nothing_is_recorded_or_verified_while_nobody_listens(tmp_path):
    # GIVEN a cache without a listener, then one subscribing mid-sequence
    cache = PagedKVCache(tiny_config(verify="full", disk_dir=str(tmp_path)))
    rec_later: list = []
    cache.add_sequence("a", prompt_len=2)
    slots = cache.reserve("a", 2)
    for layer in range(2):
        kv = torch.randn(2, 2, 8)
        cache.store(layer, slots, kv, kv)
    cache.commit("a")
    assert cache.seqs["a"].blocks[0].digest is None
    cache.bus.subscribe(rec_later.extend)
    cache.emit_read("a")
    cache.bus.flush()
    # THEN the block written unseen has no digest to verify: the read says nothing of it
    [r] = [e for e in rec_later if type(e) is Read]
    assert r.digests == [None]
    cache.close()


def test_verify_mode_comes_from_the_config_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVDOCTOR_VERIFY", "full")
    with PagedKVCache(tiny_config(disk_dir=str(tmp_path))) as cache:
        assert cache.digests.mode == "full"
    with PagedKVCache(tiny_config(disk_dir=str(tmp_path), verify="off")) as cache:
        assert cache.digests.mode == "off"
    monkeypatch.setenv("KVDOCTOR_VERIFY", "always")
    with pytest.raises(ValueError, match="KVDOCTOR_VERIFY='always'"):
        PagedKVCache(tiny_config(disk_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="EngineConfig.verify"):
        tiny_config(verify="always")


def test_wrong_scale_needs_a_quantized_device_codec(tmp_path):
    with pytest.raises(ValueError, match="wrong-scale fault needs a quantized device codec"):
        PagedKVCache(tiny_config(fault="wrong-scale", disk_dir=str(tmp_path)))


# ---- the model path: a tiny Llama through runner and scheduler ----

@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(num_layers=2, max_position_embeddings=512)


def serve(lm, *, steps: int = 24, seed: int = 0, **config) -> tuple[list, Runner]:
    """Six requests at a time through a device tier small enough to swap to host and disk; the
    findings of the whole check suite and the (closed) runner."""
    runner = Runner.create(lm.model, block_size=4, device_blocks=12, host_blocks=4, disk_blocks=32, **config)
    suite = make_suite()
    runner.bus.subscribe(suite.observe_many)
    sched = Scheduler(runner, max_batch=6)
    rng = random.Random(seed)
    for _ in range(steps):
        while len(sched.live) < 6:
            ids = [rng.randrange(3, 128) for _ in range(rng.randint(2, 14))]
            sched.submit(Request(ids, max_new_tokens=rng.randint(3, 12), ignore_eos=True,
                                 sampling=SamplingParams(greedy=False, temperature=0.8, seed=rng.randrange(1000))))
        sched.step()
    runner.close()
    suite.finish()
    return suite.findings, runner


@pytest.mark.parametrize("codec", [None, "bf16", "int8", "nf4", "mixed", "device=fp16,host=int8,disk=nf4"])
def test_clean_model_runs_give_no_finding_with_every_codec_and_swaps(tiny, codec):
    cal = None
    if codec and "int8" in codec:
        cal = calibrate(tiny.model, calibration_windows(list(range(3, 128)) * 4, num_samples=8, length=16), source="t")
    found, runner = serve(tiny, codec=codec, calibration=cal, verify="full")
    assert [f"{f.check}/{f.rule}: {f.message}" for f in found] == []
    stats = runner.cache.stats()
    moves = {k for k, n in stats["swaps"].items() if n}
    assert {"device->host", "host->device", "disk->device"} <= moves and moves & {"device->disk", "host->disk"}


@pytest.mark.parametrize("fault", CONTENT_FAULTS)
def test_each_content_fault_is_caught_naming_its_block_and_sequence(tiny, fault):
    # GIVEN the fault on, every read verified (CI's mode)
    found, runner = serve(tiny, fault=fault, codec="nf4" if fault == "wrong-scale" else None, verify="full")
    hit = runner.cache.faults.hit
    assert hit is not None, "the fault never fired"
    # THEN the only findings are integrity errors, and the first names the corrupted block, its sequence,
    # the step it happened in, and the layer where the fault chose one
    assert {f"{f.check}/{f.severity}" for f in found} == {"integrity/error"}
    first = found[0]
    assert (first.block, first.seq, first.step) == (hit["block"], hit["seq"], hit["step"])
    if hit["layer"] is not None:
        assert first.layer == hit["layer"]
    assert first.evidence["last_write"]["kind"] == "write"
