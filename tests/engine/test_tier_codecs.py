"""Per-tier codecs and mixed resolution: a block's codec travels with it, precision only goes down.

Hand-made K/V on the tiny cache of ``engine_support`` (2 layers, 2 KV heads, head_dim 8,
blocks of 4 tokens); the calibration's key scale is 5 everywhere, which the standard-normal
keys stay inside. The codecs' own accuracy is ``test_codecs``'s subject: here a re-encoded
block must hold exactly what its codec makes of the bytes it came from, within a loose bound
that no misplaced or garbled block would meet.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_support import Recorder, tiny_config
from test_runner_cli import checkpoint  # noqa: F401  (the tiny checkpoint fixture)
from kvdoctor.checks import make_suite
from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.kv.codecs import Calibration
from kvdoctor.engine.config import EngineConfig

KEY_SCALE = 5.0
CAL = Calibration(torch.full((2, 2, 8), KEY_SCALE), 1, 1, "constant 5")
PER_TIER = "device=fp32,host=int8,disk=nf4"


def cache(**kw) -> Recorder:
    kw.setdefault("calibration", CAL)
    return Recorder(PagedKVCache(tiny_config(**kw)))


def bound(codec: str, x: torch.Tensor, key: bool) -> torch.Tensor:
    """The largest error ``codec`` may add to ``x`` (H, bs, D), element-wise (a float32 slack included)."""
    if codec == "fp32":
        return torch.zeros_like(x)
    if codec in ("fp16", "bf16"):
        return x.abs() * (2**-11 if codec == "fp16" else 2**-8) + 1e-6
    if codec == "int8":
        step = torch.full_like(x, KEY_SCALE / 127) if key else x.abs().amax(-1, keepdim=True).expand_as(x) / 127
        return step * 0.5 * 1.01 + 1e-6  # +1%: the value scale is rounded to fp16
    # nf4: four bits over a range no wider than the block's (per head) largest magnitude, twice over
    return (x.abs().amax(dim=(-2, -1), keepdim=True) * 0.25).expand_as(x) + 1e-6


def decoded(r: Recorder, block: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's K, V (H, bs, D) as stored in its tier, decoded with its own codec."""
    b = r.cache.pool.blocks[block]
    arena, local = r.cache.tier_arenas[b.tier].at(b.slot)
    rows = arena.view(local, 1)[:, layer]  # (1, H, R)
    k, v = r.cache.codecs[b.codec].read(rows, layer)
    return k[0], v[0]


def written(r: Recorder, seq, block: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What was written into ``block`` of ``seq`` at ``layer``, (H, bs, D) each."""
    b, bs = r.cache.pool.blocks[block], r.cache.block_size
    k, v = r.kv[seq][layer]
    sl = slice(b.index * bs, (b.index + 1) * bs)
    return k[sl].transpose(0, 1), v[sl].transpose(0, 1)


# ---- configuration ----
def test_per_tier_codecs_in_both_forms():
    # GIVEN the dict form and the CLI's string form, and a dict that leaves a tier out
    a = tiny_config(codec={"device": "fp32", "host": "int8", "disk": "nf4"}, calibration=CAL)
    b = tiny_config(codec=PER_TIER, calibration=CAL)
    c = tiny_config(codec={"host": "int8"}, calibration=CAL)
    # THEN they resolve per tier; a tier left out takes the next faster tier's codec
    assert a.tier_codecs == b.tier_codecs == {"device": "fp32", "host": "int8", "disk": "nf4"}
    assert c.tier_codecs == {"device": "fp32", "host": "int8", "disk": "int8"}
    # AND sizes are derived per codec: each tier's arenas hold its own codec and the lossier ones below
    assert b.arena_codecs("device") == ("fp32", "int8", "nf4") and b.arena_codecs("disk") == ("nf4",)
    assert max(b.layout("nf4").payload_bytes_per_token, b.layout("int8").payload_bytes_per_token) < b.payload_bytes_per_token
    assert b.layout("nf4").bytes_per_block < b.bytes_per_block  # rows are padded to 128 bytes in every codec


def test_one_codec_stays_one_string():
    c = tiny_config(codec="fp16")
    assert c.codec == "fp16" and set(c.tier_codecs.values()) == {"fp16"} and c.block_codecs == ("fp16",)
    assert tiny_config(codec={"device": "fp16", "host": "fp16"}).codec == "fp16"


def test_bytes_capacity_uses_each_tiers_codec():
    c = tiny_config(codec=PER_TIER, calibration=CAL, host_bytes=100_000, disk_bytes=100_000)
    assert c.host_blocks == 100_000 // c.layout("int8").bytes_per_block
    assert c.disk_blocks == 100_000 // c.layout("nf4").bytes_per_block


@pytest.mark.parametrize("codec, match", [
    ("device=int8,host=fp32", r"EngineConfig.codec='device=int8,host=fp32'.*no less lossy on host \(fp32\)"),
    ({"device": "nf4", "disk": "int8"}, r"EngineConfig.codec=.*precision only goes down"),
    ("host=mixed", r"EngineConfig.codec='host=mixed'.*device tier only"),
    ("device=fp16,host=int4", r"EngineConfig.codec=.*host='int4' is not"),
    ("device=fp16,cache=nf4", r"EngineConfig.codec=.*dict from tiers"),
    ("device=fp16,host", r"EngineConfig.codec=.*TIER=CODEC"),
    (["fp16"], r"EngineConfig.codec=\['fp16'\]"),
])
def test_bad_per_tier_codecs_name_the_field(codec, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(codec=codec, calibration=CAL)


def test_a_quantized_tier_needs_the_calibration():
    with pytest.raises(ValueError, match=r"EngineConfig.calibration=None.*'int8'"):
        tiny_config(codec=PER_TIER)


def test_mixed_settings_are_validated():
    c = tiny_config(codec="mixed", calibration=CAL)
    assert c.mixed and c.tier_codecs["device"] == "fp16" and c.block_codecs == ("fp16", "nf4")  # fp32 model: fp16 high
    assert tiny_config(codec="mixed", calibration=CAL, dtype="bfloat16").tier_codecs["device"] == "bf16"
    with pytest.raises(ValueError, match="EngineConfig.mixed_low='fp16'"):
        tiny_config(codec="mixed", mixed_low="fp16", calibration=CAL)
    with pytest.raises(ValueError, match="EngineConfig.mixed_window=0"):
        tiny_config(codec="mixed", mixed_window=0, calibration=CAL)
    with pytest.raises(ValueError, match="EngineConfig.mixed_high_fraction=1.5"):
        tiny_config(codec="mixed", mixed_high_fraction=1.5, calibration=CAL)
    assert tiny_config(codec="mixed").block_codecs == ("fp16", "nf4")  # nf4 takes its ranges from the keys
    with pytest.raises(ValueError, match="EngineConfig.calibration=None"):
        tiny_config(codec="mixed", mixed_low="int8")


# ---- a block's codec travels with it ----
def test_block_keeps_codec_and_version_through_swaps():
    # GIVEN a block written on a fp32 device, with host int8 and disk nf4
    r = cache(codec=PER_TIER)
    r.add("a", 6)
    first = r.cache.block_table("a")[0]
    blk = r.cache.pool.blocks[first]
    version = blk.version
    assert blk.codec == "fp32"
    # WHEN it goes down to host, to disk, and back up to the device
    path = []
    for step in (lambda: r.cache.swap_out([first], "host"), lambda: r.cache.swap_out([first], "disk"),
                 lambda: r.cache.swap_in([first])):
        step()
        path.append((blk.tier, blk.codec, blk.version))
    # THEN it is re-encoded on each way down, keeps nf4 on the way up, and its version never changes
    assert path == [("host", "int8", version), ("disk", "nf4", version), ("device", "nf4", version)]
    r.cache.pool.check()  # and it sits in the device's nf4 arena
    assert r.cache.tier_arenas["device"].at(blk.slot)[0].codec == "nf4"
    moves = [(e.src, e.dst, e.codec, e.version) for e in r.kinds("swap_out", "swap_in") if e.block == first]
    assert moves == [("device", "host", "int8", version), ("host", "disk", "nf4", version),
                     ("disk", "device", "nf4", version)]
    assert [e.codec for e in r.kinds("alloc")] == ["fp32", "fp32"]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(0.05, 3.0))
def test_down_transcodes_decode_within_the_codec_bound(seed, scale):
    # GIVEN tokens of any magnitude inside the calibration's range, written on the device
    r = cache(codec=PER_TIER)
    r._gen.manual_seed(seed)
    r.cache.add_sequence("a")
    slots = r.cache.reserve("a", 4)
    g = torch.Generator().manual_seed(seed)
    kv = [((torch.randn(4, 2, 8, generator=g) * scale).clamp(-KEY_SCALE, KEY_SCALE),  # keys: inside calibration
           torch.randn(4, 2, 8, generator=g) * scale) for _ in range(2)]
    r.kv["a"] = kv
    for layer, (k, v) in enumerate(kv):
        r.cache.store(layer, slots, k, v)
    r.cache.commit("a")
    (b,) = r.cache.block_table("a")
    # WHEN the block goes to host (int8), then disk (nf4)
    r.cache.swap_out([b], "host")
    host = [decoded(r, b, layer) for layer in range(2)]
    r.cache.swap_out([b], "disk")
    for layer in range(2):
        k0, v0 = written(r, "a", b, layer)
        k1, v1 = host[layer]
        k2, v2 = decoded(r, b, layer)
        # THEN each copy holds what its codec makes of the bytes it came from, within the codec's bound
        for codec, (a, b_), (c, d) in (("int8", (k0, v0), (k1, v1)), ("nf4", (k1, v1), (k2, v2))):
            ek, ev = r.cache.codecs[codec].roundtrip(a[None], b_[None], layer)
            torch.testing.assert_close((c, d), (ek[0], ev[0]), atol=1e-5, rtol=1e-5)
            assert ((c - a).abs() <= bound(codec, a, True)).all() and ((d - b_).abs() <= bound(codec, b_, False)).all()


def test_up_moves_copy_the_bytes_exactly_and_verify_them():
    # GIVEN two blocks re-encoded down to disk (nf4)
    r = cache(codec=PER_TIER)
    r.add("a", 8)
    ids = r.cache.block_table("a")
    r.cache.swap_out(ids, "disk")
    before = {}
    for i in ids:
        b = r.cache.pool.blocks[i]
        arena, local = r.cache.tier_arenas["disk"].at(b.slot)
        before[i] = (arena.view(local, 1).clone(), b.checksum)
    # WHEN they come back up (disk -> device, the second one by way of the host)
    r.cache.swap_out(ids[1:], "host")
    r.cache.swap_in(ids)
    # THEN the device holds the very same bytes (and checksum), in its nf4 arena, fewer bytes than fp32
    for i in ids:
        b = r.cache.pool.blocks[i]
        arena, local = r.cache.tier_arenas["device"].at(b.slot)
        assert arena.codec == "nf4" and torch.equal(arena.view(local, 1), before[i][0])
        assert b.checksum == before[i][1] is not None
    dev = r.cache.stats()["tiers"]["device"]
    assert dev["blocks_by_codec"] == {"nf4": 2}
    assert dev["used_bytes"] == 2 * r.cache.config.layout("nf4").bytes_per_block < 2 * r.cache.config.bytes_per_block


def test_a_corrupt_recoded_copy_is_caught_coming_back():
    # GIVEN a block re-encoded to nf4 on disk, whose disk bytes then flip
    r = cache(codec=PER_TIER)
    r.add("a", 4)
    (b,) = r.cache.block_table("a")
    r.cache.swap_out([b], "disk")
    blk = r.cache.pool.blocks[b]
    arena, local = r.cache.tier_arenas["disk"].at(blk.slot)
    arena.view(local, 1).view(-1)[0] ^= 1
    # WHEN it is swapped in THEN the checksum of the new bytes catches it, and it stays on disk
    from kvdoctor.engine.errors import ChecksumMismatch

    with pytest.raises(ChecksumMismatch):
        r.cache.swap_in([b])
    assert blk.tier == "disk" and len(r.kinds("checksum_error")) == 1


def test_read_blocks_over_mixed_codecs_equals_each_block_alone():
    # GIVEN a sequence whose blocks sit in three codecs on the device (fp32, int8 and nf4 arenas)
    r = cache(codec=PER_TIER, device_blocks=6)
    r.add("a", 12)
    ids = r.cache.block_table("a")
    r.cache.swap_out(ids[:1], "host")
    r.cache.swap_out(ids[1:2], "disk")
    r.cache.swap_in(ids[:2])
    assert [r.cache.pool.blocks[i].codec for i in ids] == ["int8", "nf4", "fp32"]
    table = r.cache.slot_table("a")
    for layer in range(2):
        # WHEN attention reads them in one paged read (and per head, as block-sparse decode does)
        k, v = r.cache.read_blocks(layer, table[None])  # (1, nb, H, bs, D)
        heads = torch.tensor([[1, 0, 1]])
        kh, vh = r.cache.read_blocks(layer, table[None], heads)  # (1, nb, bs, D)
        # THEN each block equals itself decoded alone with its codec
        for j, i in enumerate(ids):
            ek, ev = decoded(r, i, layer)
            assert torch.equal(k[0, j], ek) and torch.equal(v[0, j], ev)
            assert torch.equal(kh[0, j], ek[heads[0, j]]) and torch.equal(vh[0, j], ev[heads[0, j]])
    # AND the raw view refuses, naming why
    with pytest.raises(ValueError, match=r"2 device blocks are held in other codecs.*read_blocks"):
        r.cache.layer_kv(0)


def test_appending_to_a_block_that_came_back_lossier():
    # GIVEN a partly filled tail block that went to disk (nf4) and came back
    r = cache(codec=PER_TIER)
    r.add("a", 6)
    tail = r.cache.block_table("a")[-1]
    r.cache.swap_out([tail], "disk")
    # WHEN the sequence appends (its tail is brought back up and written in its own codec)
    r.write("a", 2)
    blk = r.cache.pool.blocks[tail]
    assert blk.tier == "device" and blk.codec == "nf4"
    # THEN the new tokens read back within nf4's bound, and the fp32 block stays exact
    for layer in range(2):
        k0, v0 = written(r, "a", tail, layer)
        k, v = decoded(r, tail, layer)
        assert ((k - k0).abs() <= 2 * bound("nf4", k0, True)).all() and ((v - v0).abs() <= 2 * bound("nf4", v0, False)).all()
        got_k, _ = r.cache.gather("a", layer)
        assert torch.equal(got_k[:, :4], r.kv["a"][layer][0][:4].transpose(0, 1))


def test_checks_find_nothing_with_per_tier_codecs_and_swaps():
    # GIVEN a run that writes, swaps down and up through re-encoding tiers, reads, and ends
    r = cache(codec=PER_TIER, device_blocks=4, host_blocks=3)
    r.add("a", 8)
    r.add("b", 6)
    r.cache.end_step()
    r.add("c", 8)  # pushes older blocks down (host int8, then disk nf4)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("c")[:1], "disk")
    r.cache.ensure_resident(["a"])
    r.write("a", 3)
    r.cache.emit_read("a")
    r.cache.end_step()
    for s in ("a", "b", "c"):
        r.cache.remove_sequence(s)
    r.cache.end_step()
    assert {e.codec for e in r.kinds("swap_out")} >= {"int8", "nf4"} and r.kinds("swap_in")
    # WHEN every check reads the events THEN none has a finding
    suite = make_suite()
    for e in r.events:
        suite.observe(e)
    findings = suite.findings + suite.finish()
    assert findings == [], [f.message for f in findings]


def test_usage_events_carry_the_real_bytes():
    r = cache(codec=PER_TIER)
    r.add("a", 8)
    r.cache.swap_out(r.cache.block_table("a"), "host")
    r.cache.end_step()
    host = [e for e in r.kinds("usage") if e.tier == "host"][-1]
    assert host.used_blocks == 2 and host.bytes == 2 * r.cache.config.layout("int8").bytes_per_block


def test_single_codec_cache_is_unchanged():
    # GIVEN the default (one codec everywhere) THEN slots are plain and nothing is re-encoded
    r = cache(calibration=None)
    r.add("a", 8)
    ids = r.cache.block_table("a")
    r.cache.swap_out(ids, "disk")
    r.cache.swap_in(ids)
    r.assert_intact("a")
    assert {r.cache.pool.blocks[i].codec for i in ids} == {"fp32"} and not r.kinds("recode")
    assert r.cache.layer_kv(0).shape[0] == r.cache.arenas["device"].num_slots


# ---- mixed resolution ----
def mixed(**kw) -> Recorder:
    base = dict(codec="mixed", device_blocks=16, host_blocks=8, mixed_window=2, mixed_high_blocks=1,
                mixed_high_fraction=0.0, sink_blocks=1)
    base.update(kw)
    return cache(**base)


def test_mixed_demotes_old_unimportant_blocks_and_keeps_sink_window_and_the_most_attended():
    # GIVEN a mixed cache (window 2, one more block kept high by attention mass, sink 1)
    r = mixed()
    r.add("a", 4)
    high = r.cache.config.tier_codec("device")
    # WHEN the sequence grows block by block, and attention dwells on its third block
    for i in range(7):
        if len(r.cache.seqs["a"].blocks) == 3:
            r.cache.observe_attention("a", None, [0.1, 0.1, 5.0])
        r.write("a", 4)
    s = r.cache.seqs["a"]
    codecs = [b.codec for b in s.blocks]
    # THEN the sink, the window and the most attended block stay high; every other one is nf4
    assert codecs == [high, "nf4", high, "nf4", "nf4", "nf4", high, high]
    recodes = r.kinds("recode")
    assert [e.block for e in recodes] == [b.id for b in s.blocks if b.codec == "nf4"]
    for e in recodes:  # each demotion is a recode event, the version as written
        blk = r.cache.pool.blocks[e.block]
        assert (e.tier, e.src_codec, e.dst_codec, e.version) == ("device", high, "nf4", blk.version)
    assert not [e for e in r.kinds("write") if e.block in {x.block for x in recodes} and e.step > 0]
    r.cache.pool.check()
    # AND the bytes resident are counted per codec
    lay = r.cache.config.layout
    st_ = r.cache.stats()
    assert st_["tiers"]["device"]["blocks_by_codec"] == {high: 4, "nf4": 4}
    assert st_["kv_bytes"] == 4 * (lay(high).bytes_per_block + lay("nf4").bytes_per_block)
    # AND attention reads every block within its codec's error
    for layer in range(2):
        k, v = r.cache.gather("a", layer)  # (H, T, D)
        for j, b in enumerate(s.blocks):
            k0, v0 = written(r, "a", b.id, layer)
            kj, vj = k[:, 4 * j : 4 * j + 4], v[:, 4 * j : 4 * j + 4]
            assert ((kj - k0).abs() <= bound(b.codec, k0, True)).all()
            assert ((vj - v0).abs() <= bound(b.codec, v0, False)).all()


def test_mixed_kv_bytes_resident_go_down():
    # GIVEN rows big enough that padding does not hide the codec (head_dim 64, blocks of 16)
    cal = Calibration(torch.full((2, 2, 64), KEY_SCALE), 1, 1, "constant 5")
    kw = dict(head_dim=64, block_size=16, calibration=cal, device_blocks=16)
    dense, mix = cache(codec="fp16", **kw), mixed(**kw)
    # WHEN both hold the same 8 blocks
    for r in (dense, mix):
        r.add("a", 128)
    # THEN mixed holds 4 of them as nf4 (sink, window of 2, one kept) and takes that much less
    lay = mix.cache.config.layout
    assert mix.cache.stats()["tiers"]["device"]["blocks_by_codec"] == {"fp16": 4, "nf4": 4}
    assert dense.cache.stats()["kv_bytes"] == 8 * lay("fp16").bytes_per_block
    assert mix.cache.stats()["kv_bytes"] == 4 * lay("fp16").bytes_per_block + 4 * lay("nf4").bytes_per_block
    assert mix.cache.stats()["kv_bytes"] < dense.cache.stats()["kv_bytes"]
    assert mix.cache.stats()["recodes"] == 4
    for r in (dense, mix):  # the peak is taken at a step's end and outlives the blocks
        r.cache.end_step()
        peak = r.cache.stats()["kv_bytes"]
        r.cache.remove_sequence("a")
        r.cache.end_step()
        assert r.cache.stats()["kv_bytes"] == 0 and r.cache.stats()["peak_kv_bytes"] == peak


@settings(max_examples=25, deadline=None)
@given(writes=st.lists(st.integers(1, 9), min_size=1, max_size=8), window=st.integers(1, 3),
       keep=st.integers(0, 2), fraction=st.sampled_from([0.0, 0.25, 0.5]),
       scores=st.lists(st.floats(0, 10), min_size=16, max_size=16))
def test_mixed_never_demotes_sink_or_window_and_never_promotes(writes, window, keep, fraction, scores):
    r = mixed(mixed_window=window, mixed_high_blocks=keep, mixed_high_fraction=fraction)
    r.add("a", 1)
    high = r.cache.config.tier_codec("device")
    seen_low: set[int] = set()
    for n in writes:
        s = r.cache.seqs["a"]
        if s.length + n > 16 * 4:
            break
        r.cache.observe_attention("a", None, scores[: len(s.blocks)])
        r.write("a", n)
        blocks = s.blocks
        assert blocks[0].codec == high and all(b.codec == high for b in blocks[-window:])
        old = blocks[1:-window]
        allowed = max(keep, int(fraction * len(blocks)))
        assert sum(b.codec == high for b in old) == min(allowed, len(old))
        assert seen_low <= {b.id for b in blocks if b.codec == "nf4"}  # never promoted back
        seen_low = {b.id for b in blocks if b.codec == "nf4"}
    r.cache.pool.check()


def test_mixed_demoted_blocks_swap_down_and_back_as_nf4():
    # GIVEN a demoted block
    r = mixed()
    r.add("a", 20)
    low = [b for b in r.cache.seqs["a"].blocks if b.codec == "nf4"]
    assert low
    b = low[0]
    # WHEN it goes to host (fp16 there) and comes back THEN it stays nf4, copied, not re-encoded
    r.cache.swap_out([b.id], "host")
    assert (b.tier, b.codec) == ("host", "nf4")
    r.cache.swap_in([b.id])
    assert (b.tier, b.codec) == ("device", "nf4")
    assert [e.codec for e in r.kinds("swap_out", "swap_in")] == ["nf4", "nf4"]
    r.cache.pool.check()


def test_recode_refuses_what_it_cannot_do():
    r = mixed()
    r.add("a", 8)
    ids = r.cache.block_table("a")
    with pytest.raises(ValueError, match="the device holds fp16, nf4"):
        r.cache.recode(ids[:1], "int8")
    r.cache.swap_out(ids[:1], "host")
    with pytest.raises(ValueError, match="not settled on the device"):
        r.cache.recode(ids[:1], "nf4")
    r.cache.recode(ids[1:], "fp16")  # already that precision: nothing happens
    assert not r.kinds("recode")


def test_kvdoctor_check_finds_nothing_on_a_mixed_run_with_swaps(tmp_path, capsys):
    # GIVEN a traced run: mixed demotions, swaps of high and nf4 blocks down and back, reads, ends
    from kvdoctor.cli import main
    from kvdoctor.trace import TraceWriter

    r = mixed(device_blocks=6, host_blocks=4)
    path = tmp_path / "mixed.kvtrace"
    writer = TraceWriter(str(path), r.cache.header())
    r.cache.bus.subscribe(writer.write_many)
    r.add("a", 16)
    r.cache.end_step()
    r.add("b", 12)  # the device is full: a's blocks go down to the host
    r.cache.end_step()
    r.cache.ensure_resident(["a"])
    r.write("a", 4)
    r.cache.emit_read("a")
    r.cache.end_step()
    for s in ("a", "b"):
        r.cache.remove_sequence(s)
    r.cache.end_step()
    r.cache.close()
    writer.close()
    assert r.kinds("recode") and r.kinds("swap_out") and r.kinds("swap_in")
    # WHEN kvdoctor check reads the trace THEN it finds nothing
    code = main(["check", "--trace", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.rstrip().splitlines()[-1] == "KVDOCTOR SUMMARY: 0 errors, 0 warnings, 0 info"


# ---- kvdoctor run ----
@pytest.mark.parametrize("setting, tier_codecs", [
    ("mixed", {"device": "fp16", "host": "fp16"}),
    ("device=fp32,host=int8,disk=nf4", {"device": "fp32", "host": "int8", "disk": "nf4"}),
])
def test_run_takes_mixed_and_per_tier_codecs(checkpoint, tmp_path, capsys, monkeypatch, setting, tier_codecs):  # noqa: F811
    import json

    from test_runner_cli import _run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prompt = " ".join(f"w{i % 100 + 3}" for i in range(40))
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", prompt, "--greedy", "--max-new-tokens", "4",
                        "--block-size", "4", "--disk-blocks", "8", "--codec", setting, "--json")
    assert code == 0, out
    result = json.loads(out)
    assert result["tier_codecs"] == {**tier_codecs, **({"disk": tier_codecs["host"]} if "disk" not in tier_codecs else {})}
    assert result["peak_kv_bytes"] > 0 and (result["recodes"] > 0) == (setting == "mixed")


@pytest.mark.parametrize("setting, message", [
    ("int4", "'int4' is not one of"),
    ("device=fp16,gpu=int8", "'gpu=int8': per tier"),
    ("device=int8,host=fp16", "precision only goes down"),
])
def test_run_refuses_bad_codecs_in_one_line(checkpoint, capsys, setting, message):  # noqa: F811
    from test_runner_cli import _run

    try:
        code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", "w3 w4", "--codec", setting)
    except SystemExit as exc:  # argparse's own usage error
        code, err = exc.code, capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("listening", [True, False], ids=["listened", "unlistened"])
def test_runner_feeds_mixed_resolution_the_attention_mass(listening):
    # GIVEN a tiny model served with mixed resolution (window 2, one old block kept high by attention mass),
    # traced or not: the ranking must not depend on someone watching
    from kvdoctor.engine.model.model import tiny_llama
    from kvdoctor.engine.serving.runner import Runner

    model = tiny_llama().model
    cfg = model.config
    D = cfg.hidden_size // cfg.num_attention_heads
    cal = Calibration(torch.full((cfg.num_hidden_layers, cfg.num_key_value_heads, D), 8.0), 1, 1, "constant 8")
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0, codec="mixed", calibration=cal,
                       mixed_window=2, mixed_high_blocks=1, mixed_high_fraction=0.0) as runner:
        cache = runner.cache
        seen: list[tuple[list[float], list[float]]] = []  # (demoted, kept high) importances at each demotion
        real_recode = cache.recode

        def recode(ids, codec):  # the real recode, watched: what did the blocks weigh when it was called?
            ids = list(ids)
            owner = cache.pool.blocks[ids[0]].owners[0]
            old = cache.seqs[owner].blocks[cache.config.sink_blocks : -cache.config.mixed_window]
            kept = [cache.importance.of(b) for b in old if b.id not in ids and b.codec != "nf4"]
            seen.append(([cache.importance.of(cache.pool.blocks[i]) for i in ids], kept))
            real_recode(ids, codec)

        cache.recode = recode
        if listening:
            runner.bus.subscribe(lambda events: None)
        # WHEN it generates past several blocks, taking attention statistics every step
        from kvdoctor.engine.serving.scheduler import Request, Scheduler

        sched = Scheduler(runner)
        seq = sched.submit(Request([3 + i % 50 for i in range(30)], max_new_tokens=10, ignore_eos=True))
        gen = sched.run()[seq]
    # THEN blocks were demoted while the runner fed their attention mass, the most attended kept high
    assert len(gen.token_ids) == 10 and seen
    assert any(w > 0 for demoted, kept in seen for w in demoted + kept)
    for demoted, kept in seen:
        assert len(kept) <= 1 and all(d <= k for d in demoted for k in kept)
