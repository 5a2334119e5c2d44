"""Disaggregated prefill and decode under the vLLM plugin: two instances, four traces, one workload.

``examples/vllm_disaggregated.py`` prefills on one vLLM instance and decodes on another through the
``ExampleConnector``; each engine core and each worker writes its own trace (at TP=2 each worker its rank's
and its connector's). Checked as one workload by
``kvdoctor check -- CMD``, a clean run is silent and a store entry overwritten with another prompt's K/V is
named with the loading instance, request and block, and a decode instance with another block size than the
prefill's is named too; at TP=2 a clean run with a store entry per rank is silent (its ranks digesting their
writes), a rank that saves nothing, saves too few layers or loads too few is named, and so is a block whose bytes
change between a rank's write and its connector's save (about 2 minutes a run on 2 cores).
"""

from __future__ import annotations

import subprocess

import pytest

from example_check import check_example


def _check(*example_args: str, **environ: str) -> subprocess.CompletedProcess:
    return check_example("vllm_disaggregated.py", *example_args, **environ)


@pytest.mark.vllm
@pytest.mark.slow
def test_prefill_then_decode_is_one_clean_workload_and_its_faults_are_named():
    pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")
    # GIVEN a prefill instance and a decode instance handing K/V over through the connector's store
    clean = _check()
    # THEN all four traces (each instance's engine core and worker) are read, and nothing is found
    assert clean.returncode == 0, clean.stdout + clean.stderr[-3000:]
    assert "4 traces" in clean.stdout and "instance prefill" in clean.stdout and "instance decode" in clean.stdout
    assert "0 errors, 0 warnings, 0 info" in clean.stdout
    # WHEN one prompt's entry in the store holds another prompt's K/V of the same length
    fault = _check("--fault", "foreign-kv")
    # THEN the decode instance's load of it is named: instance, request and block
    assert fault.returncode == 1, fault.stdout + fault.stderr[-3000:]
    assert fault.stdout.count("handoff/digest-mismatch") == 1
    line = next(x for x in fault.stdout.splitlines() if "handoff/digest-mismatch" in x)
    assert " seq '" in line and " block " in line
    assert "instance decode" in fault.stdout and "saved" in fault.stdout
    # WHEN the decode instance pages its cache in blocks of 64 where the prefill used 32 (every lookup misses)
    sizes = _check("--fault", "block-size")
    # THEN the two instances sharing the store are named with the block sizes they disagree on
    assert sizes.returncode == 1, sizes.stdout + sizes.stderr[-3000:]
    assert "handoff/layout-mismatch" in sizes.stdout and "block_size (64 here, 32 there)" in sizes.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_at_tensor_parallel_2_each_rank_pairs_its_own_save_and_the_shared_files_are_named_per_request():
    pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")
    # GIVEN both instances at TP=2: each worker writes its rank's trace and its connector's beside it, and vLLM's
    # ExampleConnector names a layer's file by the prompt alone, so both prefill ranks write their heads to one
    # file and each decode rank loads whichever landed (a race, layer by layer)
    run = _check("--tp", "2", "--max-tokens", "4", "--store", "shared")
    # THEN ten traces are read (two engine cores, four ranks, four connectors): the ranks agree with each other
    # (a connector's trace is no rank's view), and tokens the connector loaded count as the ranks' writes
    assert "10 traces" in run.stdout and "tp 1 pp 0" in run.stdout, run.stdout[:2000] + run.stderr[-2000:]
    # AND a rank's load pairs with the same rank's save (its key ends in the rank), so every request has a
    # decode rank that loaded the other rank's heads in some layer, and each is named; nothing else is found
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    errors = [line for line in run.stdout.splitlines() if line.startswith(("ERROR", "WARNING", "INFO"))]
    assert {line.split()[1] for line in errors} == {"handoff/digest-mismatch"}, run.stdout[-4000:]
    assert len({line.split("seq '")[1].split("'")[0] for line in errors}) == 4, run.stdout[-4000:]
    assert "@tp" in run.stdout
    # AND each says why: both ranks saved their shares to one store entry, which ExampleConnector writes as one file
    assert run.stdout.count("Ranks tp0pp0, tp1pp0 of instance prefill") == len(errors) and "own store" in run.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_at_tensor_parallel_2_with_an_entry_per_rank_a_rank_that_saves_or_loads_less_is_named():
    pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")
    # GIVEN both instances at TP=2, each rank's share in a store folder of its own (vllm_rank_store), the ranks
    # digesting what they write
    clean = _check("--tp", "2", "--max-tokens", "4", KVDOCTOR_VLLM_RANK_DIGESTS="1")
    # THEN every rank's save answers its scheduler, saves the bytes its rank wrote, and every load pairs its
    # rank's save whole and equal: silent
    assert clean.returncode == 0, clean.stdout + clean.stderr[-3000:]
    assert "10 traces" in clean.stdout and "0 errors, 0 warnings, 0 info" in clean.stdout
    # WHEN rank 1's connectors misbehave, a request each: the prefill rank saves nothing for the first request,
    # all but layer 1 for the second; the decode rank loads all but the last layer for the first it loads
    fault = _check("--tp", "2", "--max-tokens", "4", "--fault", "ranks")
    # THEN each is named once, with the instance, the rank, the request and the block; the fourth request is clean
    assert fault.returncode == 1, fault.stdout + fault.stderr[-3000:]
    errors = [line for line in fault.stdout.splitlines() if line.startswith(("ERROR", "WARNING", "INFO"))]
    assert sorted(line.split()[1] for line in errors) == \
        ["handoff/partial-load", "handoff/save-layers", "handoff/save-missing"], fault.stdout[-4000:]
    assert all(" seq '" in line and " block " in line for line in errors)
    assert len({line.split("seq '")[1].split("'")[0] for line in errors}) == 3
    lines = fault.stdout.splitlines()
    messages = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("ERROR")]
    assert all("rank tp1pp0" in m for m in messages) and "instance decode" in fault.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_at_tensor_parallel_2_bytes_changed_between_a_ranks_write_and_its_save_are_named_with_the_layer():
    pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")
    # GIVEN the prefill instance's rank 1 with the start of the first prompt's first block changed at layer 1
    # after its forward pass wrote it and before its connector saves it (the ranks digest their writes)
    run = _check("--tp", "2", "--max-tokens", "4", "--fault", "overwrite")
    # THEN that rank's trace names the change once: instance, rank, request, block and layer; nothing else
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    errors = [line for line in run.stdout.splitlines() if line.startswith(("ERROR", "WARNING", "INFO"))]
    assert [line.split()[1] for line in errors] == ["integrity/read-mismatch"], run.stdout[-4000:]
    assert " seq '" in errors[0] and " block " in errors[0] and " layer 1 " in errors[0]
    trace = errors[0].split(" trace ")[1].split()[0]
    assert f"{trace} (instance prefill dp 0 tp 1 pp 0)" in run.stdout, run.stdout[:2000]
