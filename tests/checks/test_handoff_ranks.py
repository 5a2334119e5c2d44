"""Ranks handing K/V over (checks/handoff.py): each rank saves and loads its own share, on hand-written traces.

A disaggregated workload at tensor parallel 2 is six traces here: each instance's scheduler (its decisions: a
save or load per rank's share, naming the request) and each rank's worker (the bytes: the layers it moved and
a digest per block). Each test bends one rank and checks the traces as one workload; the clean twin is silent.
"""

from __future__ import annotations

from kvdoctor.events import TransferDone, TransferStart

from test_across_checks import check, header
from tracebuilder import rules

RANKS = ("@tp0pp0", "@tp1pp0")
ALL = [0, 1, 2, 3]


def scheduler(op: str, t: int, seq: str, blocks: list[int]) -> list:
    """A scheduler's decision for each rank's share of key k: named for its request, no bytes."""
    out = []
    for i, rank in enumerate(RANKS):
        out += [TransferStart(t=t + i, transfer=f"{op}{i}", op=op, blocks=blocks, seq=seq, key="k" + rank,
                              num_tokens=8, dst="connector:/store"),
                TransferDone(t=t + i, transfer=f"{op}{i}")]
    return out


def saved(rank: str, layers=ALL, digests=(11, 22), store="connector:/store") -> list:
    return [TransferStart(t=200, transfer="s", op="save", blocks=[0, 1], key="k" + rank, num_tokens=8,
                          layers=list(layers), digests=list(digests), dst=store),
            TransferDone(t=201, transfer="s")]


def loaded(rank: str, layers=ALL, digests=(11, 22), blocks=(5, 6)) -> list:
    return [TransferStart(t=600, transfer="l", op="load", blocks=list(blocks), key="k" + rank, num_tokens=8,
                          layers=list(layers), src="connector:/store"),
            TransferDone(t=601, transfer="l", digests=list(digests))]


def workload(tmp_path, save1=None, load1=None, save0=None):
    """Prefill (scheduler, rank 0, rank 1) then decode (scheduler, rank 0, rank 1); ``save1``/``load1`` replace
    rank 1's events, ``save0`` rank 0's save."""
    worker = dict(layers=ALL, tp_size=2)
    return check(
        tmp_path,
        (header(instance="prefill", tp_size=2), scheduler("save", 100, "req-a", [0, 1])),
        (header(instance="prefill", **worker), saved(RANKS[0]) if save0 is None else save0),
        (header(instance="prefill", **worker), saved(RANKS[1]) if save1 is None else save1),
        (header(instance="decode", tp_size=2), scheduler("load", 500, "req-b", [5, 6])),
        (header(instance="decode", **worker), loaded(RANKS[0])),
        (header(instance="decode", **worker), loaded(RANKS[1]) if load1 is None else load1))


def test_ranks_that_each_save_and_load_their_whole_share_are_silent(tmp_path):
    assert workload(tmp_path) == []


def test_a_rank_that_never_stores_is_named_with_its_request_and_blocks(tmp_path):
    # GIVEN prefill rank 1's connector saving nothing (LMCache #1807) WHEN the workload ends
    found = workload(tmp_path, save1=[])
    # THEN its scheduler's decision for rank 1's share is unanswered: instance, rank, request and block named
    assert rules(found) == ["handoff/save-missing"]
    f = found[0]
    assert (f.seq, f.block, f.evidence["rank"], f.evidence["peers_saved"]) == ("req-a", 0, "tp1pp0", ["k@tp0pp0"])
    assert "instance prefill" in f.message and "rank tp1pp0" in f.message


def test_a_rank_saving_fewer_layers_than_it_holds_is_named_and_its_digests_are_not_compared(tmp_path):
    # GIVEN prefill rank 1 saving layers 0, 1, 3 of the 0-3 it holds (its sums cover other layers than a load's)
    found = workload(tmp_path, save1=saved(RANKS[1], layers=[0, 1, 3], digests=(7, 8)))
    # THEN the save is named with the missing layer and the request its scheduler asked it for; no digest-mismatch
    assert rules(found) == ["handoff/save-layers"]
    f = found[0]
    assert (f.seq, f.block, f.layer, f.evidence["missing_layers"]) == ("req-a", 0, 2, [2])


def test_a_destination_rank_loading_fewer_layers_or_blocks_than_its_source_saved(tmp_path):
    # GIVEN decode rank 1 loading layers 0-2 of the 0-3 prefill rank 1 saved
    found = workload(tmp_path, load1=loaded(RANKS[1], layers=[0, 1, 2], digests=(5, 6)))
    # THEN the load is named with its request (from the decode scheduler's record), the layer and the block
    assert rules(found) == ["handoff/partial-load"]
    f = found[0]
    assert (f.seq, f.block, f.layer, f.evidence["rank"]) == ("req-b", 5, 3, "tp1pp0")
    # GIVEN decode rank 1 loading one block of the two saved
    found = workload(tmp_path, load1=loaded(RANKS[1], blocks=(5,), digests=(11,)))
    assert "handoff/partial-load" in rules(found) and "1 of its blocks" in found[rules(found).index(
        "handoff/partial-load")].message


def test_ranks_sharing_one_store_entry_say_why_a_load_differs(tmp_path):
    # GIVEN both prefill ranks saving their shares to one store (vLLM's ExampleConnector at TP=2: one file per
    # layer for both ranks) and decode rank 1 loading what rank 0 wrote last
    found = workload(tmp_path, load1=loaded(RANKS[1], digests=(11, 99)))
    assert rules(found) == ["handoff/digest-mismatch"]
    assert "Ranks tp0pp0, tp1pp0" in found[0].message and "own store" in found[0].message
    # AND ranks with a store each get no such explanation: the mismatch is a foreign entry
    found = workload(tmp_path, save0=saved(RANKS[0], store="connector:/store/tp0"),
                     save1=saved(RANKS[1], store="connector:/store/tp1"), load1=loaded(RANKS[1], digests=(11, 99)))
    assert rules(found) == ["handoff/digest-mismatch"] and "own store" not in found[0].message


def test_pipeline_stages_sharing_a_store_are_not_told_their_heads_collide(tmp_path):
    # GIVEN two pipeline stages (each its own layer) saving to one store and loading back in one instance, stage 0's
    # load differing from its save (stage 1 filed its layer at its offset within the stage: vllm-ascend PR #15900)
    stage = [(header(instance="pd", layers=[p], pp_size=2),
              [*saved(f"@tp0pp{p}", layers=[p]), *loaded(f"@tp0pp{p}", layers=[p], digests=(11, 99 if p == 0 else 22))])
             for p in (0, 1)]
    found = check(tmp_path, *stage)
    # THEN the load is named in stage 0's own trace, with the stages' cause, not the heads of ranks of one stage
    assert rules(found) == ["handoff/digest-mismatch"]
    assert found[0].trace.endswith("w0.kvtrace") and found[0].block == 6
    assert "Pipeline stages tp0pp0, tp0pp1" in found[0].message and "PR #15900" in found[0].message
    assert "heads" not in found[0].message


def test_an_instance_loading_back_what_it_saved_is_compared_with_its_own_save(tmp_path):
    # GIVEN one instance (kv_both) saving a key and later loading it back, equal: silent
    assert check(tmp_path, (header(instance="pd"), [*saved(""), *loaded("")])) == []
    # WHEN the store's entry changed between the save and the load
    found = check(tmp_path, (header(instance="pd"), [*saved(""), *loaded("", digests=(11, 99))]))
    # THEN the load is named against the instance's own save
    assert rules(found) == ["handoff/digest-mismatch"] and found[0].block == 6
