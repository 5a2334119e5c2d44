"""The TUI's state model: what the screens show follows from the events and findings folded in."""

from __future__ import annotations

import math

from kvdoctor.events import (
    PREFIX_CACHE, Alloc, Attn, AttnStep, Free, Header, Mem, Recode, Release, SeqEnd, SeqStart, Share, StepEnd, SwapIn,
    SwapOut, TierSpec, TraceEnd, Usage, Write,
)
from kvdoctor.findings import Finding
from kvdoctor.tui.blocks import CACHED, LEAKED, SHARED, TIER_CODES, UNOWNED
from kvdoctor.tui.details import describe_block
from kvdoctor.tui.render import event_fields
from kvdoctor.tui.state import Monitor
from kvdoctor.tui.synthetic import SyntheticWorkload

HEADER = Header(block_size=16, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=8),
                                                     TierSpec(name="host", capacity_blocks=32)])


def fold(*events, header=HEADER) -> Monitor:
    m = Monitor(header)
    for ev in events:
        m.observe(ev)
    return m


def tier(snapshot, name):
    return next(t for t in snapshot.tiers if t.name == name)


def test_alloc_share_and_free_move_blocks_between_owned_shared_and_free():
    # GIVEN two sequences, one block shared by both and one owned by one
    m = fold(
        SeqStart(seq=1, prompt_len=4), SeqStart(seq=2, prompt_len=4),
        Alloc(block=0, tier="device", seq=1), Share(block=0, seq=2), Alloc(block=1, tier="device", seq=2),
    )
    # THEN the gauge counts one owned and one shared block, and the cells say so
    s = m.snapshot()
    assert (tier(s, "device").owned, tier(s, "device").shared, tier(s, "device").free) == (1, 1, 6)
    assert s.cells[s.cell_ids.index(0)] & SHARED
    # WHEN block 1 is freed
    m.observe(Free(block=1))
    # THEN it is no longer counted and its cell is free
    s = m.snapshot()
    assert tier(s, "device").owned == 0 and s.cells[s.cell_ids.index(1)] == 0


def test_block_left_without_owner_at_step_end_is_shown_unowned_then_leaked_by_finding():
    # GIVEN a block swapped out to host whose sequence ends without freeing it
    m = fold(
        SeqStart(seq=7, prompt_len=16), Alloc(block=3, tier="device", seq=7),
        Write(block=3, seq=7, pos=0, n=16, version=16), SwapOut(block=3, src="device", dst="host", version=16),
        SeqEnd(seq=7, reason="aborted"),
    )
    # WHEN the step has not ended yet THEN it is not flagged (it may still be freed in this step)
    assert not m.snapshot().cells[0] & UNOWNED
    # WHEN the step ends THEN it shows as leaked on host
    m.observe(StepEnd(num_tokens=16))
    s = m.snapshot()
    assert s.cells[0] & UNOWNED and s.cells[0] & 3 == TIER_CODES["host"]
    assert tier(s, "host").leaked == 1
    # WHEN the leak check names it THEN it carries the leak flag and the finding is listed
    m.add_finding(Finding(check="leak", rule="unreachable-swapped", severity="error", message="m", block=3, seq=7, step=0))
    s = m.snapshot()
    assert s.cells[0] & LEAKED and s.num_findings["error"] == 1 and s.findings[-1].block == 3


def test_release_then_free_in_the_same_step_is_not_unowned():
    m = fold(SeqStart(seq=1, prompt_len=1), Alloc(block=0, tier="device", seq=1), Release(block=0, seq=1),
             Free(block=0), StepEnd())
    assert m.snapshot().cells[0] == 0


def test_rates_come_from_the_trace_clock_so_a_replay_shows_the_workloads_rates():
    # GIVEN steps 10 ms apart of 5 tokens each
    m = fold(*(ev for k in range(5) for ev in (Usage(t=k * 10_000_000, step=k, tier="device", used_blocks=k,
                                                       capacity_blocks=8),
                                                StepEnd(t=k * 10_000_000 + 1, step=k, num_tokens=5))))
    s = m.snapshot()
    # THEN tokens/s is 5 per 10 ms, whatever the wall clock did
    assert math.isclose(s.tokens_per_s, 500.0, rel_tol=1e-6)
    assert s.step == 5 and tier(s, "device").spark[-3:] == (2, 3, 4)


def test_attention_is_averaged_per_layer_and_step_and_anomalies_are_marked():
    m = fold(
        Attn(step=0, seq=1, layer=0, max_logit=4.0, entropy=1.0, sink=0.1, nonfinite=0),
        Attn(step=0, seq=2, layer=0, max_logit=6.0, entropy=3.0, sink=0.1, nonfinite=0),
        StepEnd(step=0),
        Attn(step=1, seq=1, layer=0, max_logit=float("nan"), entropy=2.0, sink=0.1, nonfinite=2),
        StepEnd(step=1),
    )
    m.add_finding(Finding(check="attention", rule="nonfinite", severity="error", message="nan", layer=0, step=1))
    layer = m.snapshot().layers[0]
    assert layer.steps == (0, 1) and layer.entropy == (2.0, 2.0)
    assert layer.max_logit[0] == 6.0 and math.isnan(layer.max_logit[1])
    assert layer.nonfinite == (0, 2) and layer.anomalies == frozenset({1})


def test_an_attn_step_shows_as_its_attn_events_and_logs_as_grid_shapes():
    # GIVEN the statistics of two rows at two layers as one attn_step, and as the four attn events it stands for
    step = AttnStep(step=0, seqs=[1, 2], max_logit=[[4.0, 6.0], [5.0, 7.0]], entropy=[[1.0, 3.0], [2.0, 2.0]],
                    sink=[[0.1, 0.1], [0.2, 0.2]], nonfinite=[[0, 0], [0, 1]])
    together, apart = fold(step, StepEnd(step=0)), fold(*step.rows(), StepEnd(step=0))
    # THEN the monitor's layers are the same either way
    assert together.snapshot().layers == apart.snapshot().layers
    assert together.snapshot().layers[1].nonfinite == (1,)
    # AND its log line gives the grids' shapes, not 2 x 2 numbers each
    assert event_fields(step) == "seqs=[1,2] max_logit=[2×2] entropy=[2×2] sink=[2×2] nonfinite=[2×2]"


def test_memory_series_hold_one_sample_per_step():
    m = fold(Mem(step=0, rss=100, py_heap=10), StepEnd(step=0), Mem(step=1, rss=150), StepEnd(step=1),
             Usage(step=2, tier="host", used_blocks=2, capacity_blocks=32, bytes=2048), StepEnd(step=2))
    memory = dict(m.snapshot().memory)
    assert memory["RSS"] == (100, 150, 150)
    assert memory["Python heap"] == (10, 10, 10)
    assert memory["KV host"][-1] == 2048


def test_trace_end_and_finish_say_why_the_source_stopped():
    m = fold(TraceEnd(reason="closed"))
    assert m.snapshot().ended == "trace closed (closed)"
    m.finish("workload crashed (exit 1): boom")
    assert m.snapshot().ended == "workload crashed (exit 1): boom"


def test_snapshot_is_a_copy_that_later_events_do_not_change():
    m = fold(SeqStart(seq=1, prompt_len=1), Alloc(block=0, tier="device", seq=1))
    before = m.snapshot()
    m.observe(Free(block=0))
    assert before.cells[0] != 0 and len(before.log) == 2 and m.snapshot().serial > before.serial


def test_synthetic_workload_without_fault_leaves_nothing_unowned():
    w = SyntheticWorkload(num_steps=200)
    m = fold(*w.events(), header=w.header())
    s = m.snapshot()
    assert all(t.leaked == 0 for t in s.tiers)
    assert sum(1 for ev in m.log if type(ev).__name__ == "SwapOut") > 0  # the load does swap


def test_lookup_of_sequences_by_typed_text():
    m = fold(SeqStart(seq=3, prompt_len=1), SeqStart(seq="req-a", prompt_len=1))
    assert m.find_seq("3").seq == 3 and m.find_seq("req-a").seq == "req-a" and m.find_seq("4") is None


def test_synthetic_workload_is_clean_for_the_checks_and_each_fault_trips_its_own_rule():
    from kvdoctor.checks import make_suite

    expected = {None: set(), "leak-swapped": {"leak/unreachable-swapped"}, "stale-version": {"stale/stale-swap-in"},
                "attention-nan": {"attention/nonfinite"}}
    for fault, rules in expected.items():
        suite = make_suite()
        found = [f for ev in SyntheticWorkload(num_steps=300, fault=fault).events() for f in suite.observe(ev)]
        found += suite.finish()
        assert {f"{f.check}/{f.rule}" for f in found} == rules, fault


def test_block_detail_shows_the_codec_its_bytes_are_held_in_and_its_recodes():
    # GIVEN a block allocated at fp16, swapped out as int8, back up as int8, then demoted to nf4 in place
    m = fold(
        SeqStart(seq=1, prompt_len=4), Alloc(block=3, tier="device", seq=1, codec="fp16"),
        SwapOut(block=3, src="device", dst="host", version=4, codec="int8"),
        SwapIn(block=3, src="host", dst="device", version=4, codec="int8"),
        Recode(block=3, tier="device", src_codec="int8", dst_codec="nf4", version=4),
    )
    # THEN the detail names the tier and codec now, and the history holds the recode
    text = describe_block(m, 3).plain
    assert text.startswith("block 3  device nf4")
    assert "recode" in text


def test_a_recode_of_a_block_never_seen_allocated_is_told_without_placing_it():
    # GIVEN a monitor that joined a run late: the first it hears of block 0 is a recode
    m = fold(Recode(block=0, tier="device", src_codec="fp16", dst_codec="nf4", version=4))
    # THEN the block has a story (the recode) and its codec, but no tier holds it and its cell is free
    rec = m.blocks.records[0]
    assert [type(e) for e in rec.history] == [Recode] and rec.codec == "nf4"
    s = m.snapshot()
    assert s.cells[s.cell_ids.index(0)] == 0 and all(t.used == 0 for t in s.tiers)
    assert describe_block(m, 0).plain.startswith("block 0  free nf4")


def test_prefix_cache_blocks_are_marked_cached_and_the_hit_rate_counts_served_prompt_blocks():
    # GIVEN a request whose first block the prefix cache registers, then a second request that hits it
    m = fold(
        SeqStart(seq=1, prompt_len=20), Alloc(block=0, tier="device", seq=1), Alloc(block=1, tier="device", seq=1),
        Share(block=0, seq=PREFIX_CACHE, hash="k0"), StepEnd(prefix_hits=0, prefix_misses=1),
        SeqEnd(seq=1, step=1), Free(block=1, step=1), SeqStart(seq=2, prompt_len=20, step=1),
        Share(block=0, seq=2, hash="k0", step=1), StepEnd(step=1, prefix_hits=1, prefix_misses=0),
    )
    s = m.snapshot()
    # THEN the cached block's cell says so, and one of two looked-up prompt blocks was served
    assert s.cells[0] & CACHED and not s.cells[1]
    assert (s.prefix_hits, s.prefix_lookups, s.prefix_hit_rate) == (1, 2, 0.5)


def test_without_a_prefix_cache_there_is_no_hit_rate():
    s = fold(SeqStart(seq=1, prompt_len=4), Alloc(block=0, tier="device", seq=1), StepEnd()).snapshot()
    assert s.prefix_hit_rate is None and not s.cells[0] & CACHED
