"""The rules across a workload's traces (checks/ranks.py, checks/handoff.py), on hand-written traces.

Each test writes one trace per rank or instance with ``TraceBuilder``, bends one fact, and checks the
traces as one workload (``kvdoctor.workload``), as ``kvdoctor check --trace DIR`` does; the same traces
without the bend are the near miss that stays silent.
"""

from __future__ import annotations

import msgspec

from kvdoctor.checks import RanksCheck, TraceTag
from kvdoctor.events import Header, TierSpec, TransferDone, TransferStart
from kvdoctor.trace import TraceWriter
from kvdoctor.workload import TraceSet, WorkloadSession

from tracebuilder import TraceBuilder, rules


def header(block_size=4, num_layers=4, **who) -> Header:
    return Header(block_size=block_size, num_layers=num_layers, tiers=[TierSpec(name="device", capacity_blocks=64)],
                  t0=1_000_000, **who)


def check(tmp_path, *traces: tuple[Header, list]):
    """The traces' findings, checked as one workload in this process and by worker processes, which must agree
    finding for finding, in order."""
    paths = []
    for i, (h, events) in enumerate(traces):
        path = tmp_path / f"w{i}.kvtrace"
        with TraceWriter(path, h) as w:
            w.write_many(events)
        paths.append(str(path))
    here = WorkloadSession(TraceSet.open(paths), workers=1).run()
    pooled = WorkloadSession(TraceSet.open(paths), workers=2).run()
    assert (pooled._pool is not None) == (len(paths) > 1) and here._pool is None
    assert msgspec.json.encode(pooled.findings) == msgspec.json.encode(here.findings)
    return here.findings


def rank_steps(diverge: bool = False) -> list:
    """Two steps of one engine's decisions: a request admitted with two blocks, then one more token."""
    b = TraceBuilder()
    b.start("r1", prompt_len=8)
    b.batch(["r1"], n=[8])
    blocks = [0, 1]
    for blk in blocks:
        b.alloc(blk, "r1")
        b.write(blk, "r1", 4)
    b.end_step()
    b.batch(["r1"])
    b.alloc(7 if diverge else 2, "r1")
    b.write(7 if diverge else 2, "r1", 1)
    b.read("r1", [*blocks, 7 if diverge else 2])
    b.end_step()
    b.end("r1")
    for blk in (*blocks, 7 if diverge else 2):
        b.free(blk)
    b.end_step()
    return b.events


# ---- ranks -----------------------------------------------------------------------------------


def test_tensor_parallel_ranks_that_decide_alike_are_silent(tmp_path):
    # GIVEN two TP ranks of one instance recording the same decisions WHEN checked as one workload THEN silent
    found = check(tmp_path, (header(instance="p", tp_rank=0, tp_size=2), rank_steps()),
                  (header(instance="p", tp_rank=1, tp_size=2), rank_steps()))
    assert found == []


def test_a_rank_that_allocates_another_block_diverges(tmp_path):
    # GIVEN rank 1 handing the request block 7 where rank 0 handed it block 2
    found = check(tmp_path, (header(instance="p", tp_rank=0, tp_size=2), rank_steps()),
                  (header(instance="p", tp_rank=1, tp_size=2), rank_steps(diverge=True)))
    # THEN one divergence, at that step, on rank 1's trace, naming both decisions
    assert rules(found) == ["ranks/divergence"]
    f = found[0]
    assert f.step == 1 and f.trace.endswith("w1.kvtrace") and f.block == 7 and f.seq == "r1"
    assert "tp 1" in f.message and "alloc 7 device r1" in f.message and "alloc 2 device r1" in f.message


def test_traces_that_name_no_rank_are_engines_of_their_own(tmp_path):
    # GIVEN two caches of one process (no ranks in their headers) deciding differently THEN nothing to compare
    assert check(tmp_path, (header(), rank_steps()), (header(), rank_steps(diverge=True))) == []


def test_ranks_of_one_engine_must_start_alike(tmp_path):
    # GIVEN rank 1 started with a block size of 8 and another pool
    found = check(tmp_path, (header(instance="p", tp_rank=0, tp_size=2), rank_steps()),
                  (header(block_size=8, instance="p", tp_rank=1, tp_size=2, kv_layout="HND"), []))
    assert rules(found) == ["ranks/startup-mismatch"]
    assert found[0].evidence["mine"] == {"block_size": 8, "kv_layout": "HND"}
    # AND ranks of two data-parallel engines may differ: they are different engines
    assert check(tmp_path, (header(instance="p", dp_rank=0, tp_rank=0), []),
                 (header(block_size=8, instance="p", dp_rank=1, tp_rank=0), [])) == []


def test_pipeline_stages_hold_disjoint_layers_and_read_only_their_own(tmp_path):
    ok = [dict(pp_rank=0, pp_size=2, layers=[0, 1]), dict(pp_rank=1, pp_size=2, layers=[2, 3])]
    assert check(tmp_path, *[(header(instance="p", **s), []) for s in ok]) == []
    # GIVEN stage 1 claiming layer 1 too THEN the overlap is named
    bad = [ok[0], dict(pp_rank=1, pp_size=2, layers=[1, 2, 3])]
    found = check(tmp_path, *[(header(instance="p", **s), []) for s in bad])
    assert rules(found) == ["ranks/stage-layers"] and found[0].layer == 1
    # GIVEN stage 1 reading K/V at layer 0, which stage 0 holds (K/V at another stage's offsets)
    b = TraceBuilder()
    b.start("r", prompt_len=4)
    b.batch(["r"], n=[4])
    b.alloc(3, "r")
    b.write(3, "r", 4)
    b.read("r", [3], layer=0)
    b.end("r")
    b.free(3)
    b.end_step()
    found = check(tmp_path, (header(instance="p", **ok[0]), []), (header(instance="p", **ok[1]), b.events))
    assert rules(found) == ["ranks/foreign-layer"] and found[0].layer == 0 and found[0].block == 3


# ---- handoff ---------------------------------------------------------------------------------


def save(key="k1", digests=(11, 22), num_tokens=8, t=100, done=True):
    out = [TransferStart(t=t, transfer="s1", op="save", blocks=[0, 1], seq="req-a", key=key, num_tokens=num_tokens,
                         digests=list(digests))]
    return out + [TransferDone(t=t + 10, transfer="s1")] if done else out


def load(key="k1", digests=(11, 22), num_tokens=8, t=500, blocks=(5, 6)):
    return [TransferStart(t=t, transfer="l1", op="load", blocks=list(blocks), seq="req-b", key=key,
                          num_tokens=num_tokens),
            TransferDone(t=t + 10, transfer="l1", digests=list(digests))]


def test_a_clean_handoff_is_silent(tmp_path):
    assert check(tmp_path, (header(instance="prefill"), save()), (header(instance="decode"), load())) == []


def test_a_load_of_other_kv_than_the_source_saved_names_instance_request_and_block(tmp_path):
    # GIVEN the decode instance's second block arriving with other content than the prefill saved
    found = check(tmp_path, (header(instance="prefill"), save()), (header(instance="decode"), load(digests=(11, 99))))
    assert rules(found) == ["handoff/digest-mismatch"]
    f = found[0]
    assert (f.seq, f.block, f.trace.endswith("w1.kvtrace")) == ("req-b", 6, True)
    assert f.evidence["source_block"] == 1 and f.evidence["source_seq"] == "req-a" and "instance decode" in f.message


def test_a_load_before_its_save_finished_is_named(tmp_path):
    # GIVEN the save still in flight when the load starts (its done comes after, by wall-clock)
    events = save(done=False) + [TransferDone(t=900, transfer="s1")]
    found = check(tmp_path, (header(instance="prefill"), events), (header(instance="decode"), load()))
    assert rules(found) == ["handoff/load-unsaved"] and found[0].evidence["save_state"] == "in flight"


def test_instances_that_disagree_on_block_size_or_token_count(tmp_path):
    # GIVEN a decode instance with blocks of 8 tokens loading what a prefill with blocks of 4 saved
    found = check(tmp_path, (header(instance="prefill"), save()),
                  (header(block_size=8, instance="decode"), load(blocks=(5,))))
    assert rules(found) == ["handoff/layout-mismatch"] and "block_size (8 here, 4 at the source)" in found[0].message
    # GIVEN the destination mapping 12 tokens where the source saved 8
    found = check(tmp_path, (header(instance="prefill"), save()),
                  (header(instance="decode"), load(num_tokens=12, blocks=(5, 6, 7))))
    assert rules(found) == ["handoff/block-map"] and found[0].evidence["source_num_tokens"] == 8
    # GIVEN a save that lists three blocks for 8 tokens at block size 4
    bad = [TransferStart(t=1, transfer="s", op="save", blocks=[0, 1, 2], seq="a", num_tokens=8)]
    found = check(tmp_path, (header(instance="prefill"), bad))
    assert rules(found) == ["handoff/block-map"] and found[0].evidence["blocks"] == [0, 1, 2]


def test_instances_sharing_a_store_must_agree_on_block_size_even_when_no_key_pairs(tmp_path):
    # GIVEN a prefill instance with blocks of 4 and a decode instance with blocks of 8 saving to the same store
    # (the block size changes the keys, so no load pairs with a save: every lookup just misses)
    store = dict(dst="connector:/shared")
    prefill = [TransferStart(t=1, transfer="s", op="save", blocks=[0, 1], seq="a", key="k4", num_tokens=8, **store)]
    decode = [TransferStart(t=2, transfer="s", op="save", blocks=[0], seq="b", key="k8", num_tokens=8, **store)]
    found = check(tmp_path, (header(instance="prefill"), prefill), (header(block_size=8, instance="decode"), decode))
    # THEN the mismatch is named once, on the later instance
    assert rules(found) == ["handoff/layout-mismatch"] and found[0].evidence["store"] == "connector:/shared"
    assert found[0].trace.endswith("w1.kvtrace") and "block_size (8 here, 4 there)" in found[0].message
    # AND the same store used by instances that agree is silent
    alike = [TransferStart(t=2, transfer="s", op="save", blocks=[3, 4], seq="b", key="k9", num_tokens=8, **store)]
    assert check(tmp_path, (header(instance="prefill"), prefill), (header(instance="decode"), alike)) == []


def _late_join(diverge: bool) -> list:
    """Rank 0's trace read through its steps before rank 1's trace is found (a worker's trace that a followed
    folder shows later), as a live workload hands records to the ranks rule."""
    check, found = RanksCheck(), []
    tags = [TraceTag(index=i, name=f"w{i}", header=header(instance="p", tp_rank=i, tp_size=2)) for i in range(2)]
    recorders = [check.recorder(tag) for tag in tags]
    found += check.trace_added(tags[0])
    found += check.see_records(tags[0], recorders[0].record(rank_steps()))
    found += check.trace_added(tags[1])
    found += check.see_records(tags[1], recorders[1].record(rank_steps(diverge)))
    for tag, recorder in zip(tags, recorders):
        found += check.see_records(tag, recorder.end(), ended=True)
    return found


def test_a_rank_whose_trace_joins_late_is_compared_step_by_step_not_against_nothing(tmp_path):
    # GIVEN rank 1's trace joining after rank 0 finished its steps (seen in a clean vLLM TP=2 run under load)
    # THEN its steps are compared with rank 0's, not with "nothing", and a real divergence is still named
    assert _late_join(diverge=False) == []
    late = _late_join(diverge=True)
    assert rules(late) == ["ranks/divergence"] and late[0].step == 1 and late[0].block == 7
