"""KV codecs: round-trip error bounds (properties), byte sizes, deterministic calibration, the cache's stored blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.kv.codecs import (
    NF4_LEVELS,
    Calibration,
    calibrate,
    calibration_windows,
    make_codec,
)
from kvdoctor.engine.config import EngineConfig

from engine_support import Recorder, tiny_config

H, D, BS = 2, 64, 16
_NF4_HALF_GAP = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:])) / 2


def _kv(seed: int, spread: float, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with outlier channels (a per-channel spread), values without; (n, H, BS, D) each."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.exp(torch.linspace(0, spread, D))[torch.randperm(D, generator=g)]
    return torch.randn(n, H, BS, D, generator=g) * channel, torch.randn(n, H, BS, D, generator=g) * (1 + spread)


def _calibration(k: torch.Tensor) -> Calibration:
    return Calibration.from_keys([k.transpose(0, 1).reshape(1, H, -1, D)], source="test")


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 10_000), spread=st.floats(0.0, 4.0))
def test_native_codecs_round_off_like_their_dtype(seed, spread):
    # GIVEN keys and values of any scale
    k, v = _kv(seed, spread)
    for name, eps in (("fp32", 0.0), ("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        # WHEN stored and read back
        k2, v2 = make_codec(name, BS, D).roundtrip(k, v)
        # THEN every element is within half an ulp of the dtype (relative; absolute among FP16 subnormals)
        assert ((k2 - k).abs() <= k.abs() * eps + 2.0**-25).all(), name
        assert ((v2 - v).abs() <= v.abs() * eps + 2.0**-25).all(), name


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 10_000), spread=st.floats(0.0, 4.0))
def test_int8_error_is_half_a_step_of_the_channel_or_token_scale(seed, spread):
    # GIVEN a calibration that has seen these keys
    k, v = _kv(seed, spread)
    cal = _calibration(k)
    k2, v2 = make_codec("int8", BS, D, calibration=cal).roundtrip(k, v)
    # THEN a key is off by at most half a step of its channel's scale (keys per channel), give or take the
    # float32 rounding of k / step and back (a key of 22.45 at a step of 0.314 sits on a half step: the
    # quotient rounds either way and the error reads 5e-6 over the half step; seed 181, spread 3.36) ...
    step_k = cal.key_scale[0][None, :, None, :] / 127  # (1, H, 1, D)
    assert ((k2 - k).abs() <= step_k * 0.5 + 4 * torch.finfo(torch.float32).eps * k.abs() + 1e-6).all()
    # ... and a value by at most half a step of its token's absmax (values per token; FP16 scale)
    step_v = v.abs().amax(dim=-1, keepdim=True) / 127
    assert ((v2 - v).abs() <= step_v * 0.51 + 1e-6).all()


def _key_bound(k: torch.Tensor, growths: torch.Tensor | int = 0) -> torch.Tensor:
    """Largest nf4 key error: half a step of the channel's range over its key group (the group is the
    block here: BS = 16 tokens), its FP16-rounded ends, and half a step more per time a token
    arriving later widened the range (``growths``, per channel)."""
    lo, hi = k.amin(dim=2, keepdim=True), k.amax(dim=2, keepdim=True)  # (n, H, 1, D)
    return (hi - lo) / 30 * (1 + growths) + (lo.abs() + hi.abs()) * 2.0**-10 + 1e-6


def _value_bound(v: torch.Tensor) -> torch.Tensor:
    """Largest nf4 value error per token (L2): values are rotated by an orthonormal Hadamard matrix (which
    keeps norms), then each group of 32 channels is off by at most half the widest NF4 gap of its absmax."""
    h = torch.ones(1, 1)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    rot = v @ (h / D**0.5)
    gmax = rot.abs().unflatten(-1, (-1, 32)).amax(-1)  # (..., D/32)
    return ((gmax * (_NF4_HALF_GAP + 2e-3)) ** 2 * 32).sum(-1).sqrt() + 1e-6


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 10_000), spread=st.floats(0.0, 4.0))
def test_nf4_keys_per_channel_and_values_per_token_stay_within_half_a_step(seed, spread):
    # GIVEN keys with outlier channels and values of any scale
    k, v = _kv(seed, spread)
    # WHEN stored as nf4 and read back
    k2, v2 = make_codec("nf4", BS, D, calibration=_calibration(k)).roundtrip(k, v)
    # THEN a key is off by at most half a step of its channel's range over the group
    assert ((k2 - k).abs() <= _key_bound(k)).all()
    # ... and a value token by at most half an NF4 gap per rotated group (in L2)
    assert ((v2 - v).norm(dim=-1) <= _value_bound(v)).all()


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 10_000), spread=st.floats(0.0, 4.0))
def test_nf4_keys_written_one_token_at_a_time_drift_only_when_the_range_grows(seed, spread):
    # GIVEN a block's tokens written one at a time (decoding), as the cache writes them
    k, v = _kv(seed, spread, n=2)
    codec = make_codec("nf4", BS, D, calibration=_calibration(k))
    rows = torch.zeros(2, H, -(-codec.payload_bytes // 128) * 128, dtype=torch.uint8)
    for t in range(BS):
        codec.write(rows, 0, torch.arange(2), torch.full((2,), t), k[:, :, t], v[:, :, t])
    k2, v2 = codec.read(rows, 0)
    # THEN values are what a whole-block encoding gives (per token), and keys are within half a step
    # of the final range per time a later token widened their channel's range
    _, v_block = codec.roundtrip(k, v)
    assert torch.equal(v2, v_block)
    run_lo, run_hi = k.cummin(dim=2).values, k.cummax(dim=2).values  # (n, H, BS, D)
    grew = (run_lo[:, :, 1:] < run_lo[:, :, :-1]) | (run_hi[:, :, 1:] > run_hi[:, :, :-1])
    assert ((k2 - k).abs() <= _key_bound(k, grew.sum(dim=2, keepdim=True))).all()


def test_nf4_keys_do_not_drift_while_the_range_holds():
    # GIVEN a group whose first two tokens hold every channel's minimum and maximum
    k, v = _kv(7, 3.0, n=1)
    lo, hi = k.amin(dim=2, keepdim=True), k.amax(dim=2, keepdim=True)
    k = torch.cat([lo, hi, k[:, :, 2:]], dim=2)
    codec = make_codec("nf4", BS, D, calibration=_calibration(k))
    rows = torch.zeros(1, H, -(-codec.payload_bytes // 128) * 128, dtype=torch.uint8)
    # WHEN written one token at a time
    for t in range(BS):
        codec.write(rows, 0, torch.zeros(1, dtype=torch.long), torch.tensor([t]), k[:, :, t], v[:, :, t])
    # THEN the bytes are those of the whole block encoded at once: re-encoding a group is exact
    assert torch.equal(rows, codec.encode_rows(k, v, torch.zeros(1, dtype=torch.long), rows.shape[-1]))


def test_quantized_rows_are_a_fraction_of_fp16():
    cal = Calibration(torch.ones(30, 3, 64), 1, 1, "ones")
    sizes = {c: EngineConfig(num_layers=30, num_kv_heads=3, head_dim=64, block_size=64, codec=c, calibration=cal)
             .bytes_per_block for c in ("fp16", "int8", "nf4")}
    assert sizes["int8"] / sizes["fp16"] <= 0.53
    assert sizes["nf4"] / sizes["fp16"] <= 0.30
    # every scale is counted: nf4 is 4-bit codes for K and V, FP16 key ranges per channel and 32 tokens,
    # one FP16 absmax per 32 value channels
    assert sizes["nf4"] == 30 * 3 * (64 * 64 + 2 * 2 * 2 * 64 + 64 * 2 * 2)


def test_quantized_codecs_need_a_matching_calibration():
    with pytest.raises(ValueError, match=r"EngineConfig.calibration=None.*\(2, 2, 8\)"):
        tiny_config(codec="int8")
    with pytest.raises(ValueError, match="calibration"):
        tiny_config(codec="nf4", calibration=Calibration(torch.ones(1, 2, 8), 1, 1, "wrong shape"))
    with pytest.raises(ValueError, match="EngineConfig.codec='int4'"):
        tiny_config(codec="int4")


def test_calibration_is_deterministic_and_survives_a_round_trip(tmp_path):
    from kvdoctor.engine.model.model import tiny_llama

    # GIVEN the same model and text
    model = tiny_llama().model
    ids = [(i * 37) % 120 + 3 for i in range(600)]
    windows = calibration_windows(ids, num_samples=40, length=16)
    # WHEN calibrated twice
    a = calibrate(model, windows, source="synthetic", batch_size=16)
    b = calibrate(model, windows, source="synthetic", batch_size=16)
    # THEN the scales are bit-identical, and the stored copy loads back the same
    assert torch.equal(a.key_scale, b.key_scale) and a.digest == b.digest
    assert a.num_samples == 40 and a.num_tokens == 640 and a.shape == (2, 2, 16)
    a.save(str(tmp_path / "cal.safetensors"))
    c = Calibration.load(str(tmp_path / "cal.safetensors"))
    assert torch.equal(c.key_scale, a.key_scale) and c.source == "synthetic" and c.digest == a.digest
    # AND the scales bound every key the calibration saw (RoPE pairs share their norm)
    assert windows == calibration_windows(ids, num_samples=40, length=16)


@pytest.mark.parametrize("codec", ["fp16", "int8", "nf4"])
def test_cache_stores_encoded_blocks_and_keeps_them_through_swaps(make_cache, tmp_path, codec):
    # GIVEN a cache whose blocks are stored under a codec, in all three tiers
    cal = Calibration(torch.full((2, 2, 8), 4.0), 1, 1, "flat")
    r = make_cache(codec=codec, calibration=cal)
    r.add("a", 7)
    k0, v0 = r.cache.gather("a", 1)
    # THEN what is read back is the codec's round trip of what was written
    want_k, want_v = r.expected("a", 1)
    tol = {"fp16": 1e-3, "int8": 0.05, "nf4": 0.5}[codec]
    assert (k0 - want_k).abs().max() < tol * 4 and (v0 - want_v).abs().max() < tol * 4
    ids = r.cache.block_table("a")
    versions = [r.cache.pool.blocks[b].version for b in ids]
    # WHEN its blocks go to host, then disk, and come back
    r.cache.end_step()
    r.cache.swap_out(ids, "host")
    r.cache.swap_out(ids, "disk")
    r.cache.swap_in(ids)
    # THEN each block keeps its version and its bytes (the decoded K/V are bit-identical)
    assert [r.cache.pool.blocks[b].version for b in ids] == versions
    assert {(e.block, e.version) for e in r.kinds("swap_out", "swap_in")} == set(zip(ids, versions))
    k1, v1 = r.cache.gather("a", 1)
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_layer_kv_refuses_a_quantized_arena(make_cache):
    r: Recorder = make_cache(codec="int8", calibration=Calibration(torch.ones(2, 2, 8), 1, 1, "ones"))
    with pytest.raises(ValueError, match="read_blocks"):
        r.cache.layer_kv(0)
