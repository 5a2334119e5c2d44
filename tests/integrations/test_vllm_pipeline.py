"""vLLM at pipeline parallel size 2 under the plugin: two stages, each with its rank's and its connector's trace.

``examples/vllm_pipeline.py`` runs a small random two-layer Llama at PP=2 (a layer a stage) with vLLM's
``ExampleConnector``: the first pass saves each prompt's K/V, each stage its own layer, and the second loads it
back. Checked as one workload by ``kvdoctor check -- CMD``, a clean run is silent; a stage whose connector
files its layers at stage-local offsets (vllm-ascend PR #15900) is named with the stage, request and block that
load another stage's K/V (about 2 minutes a run on 2 cores: vLLM compiles the model, see the example).
"""

from __future__ import annotations

import subprocess

import pytest

from example_check import check_example


def _check(*example_args: str) -> subprocess.CompletedProcess:
    return check_example("vllm_pipeline.py", *example_args)


@pytest.mark.vllm
@pytest.mark.slow
def test_two_pipeline_stages_are_one_clean_workload_and_a_stage_at_the_wrong_layer_offsets_is_named():
    pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")
    # GIVEN two pipeline stages saving their layers' K/V through the connector and loading them back
    clean = _check()
    # THEN five traces are read (the engine core; each stage's rank and connector), each stage with its layer,
    # and nothing is found
    assert clean.returncode == 0, clean.stdout + clean.stderr[-3000:]
    assert "5 traces" in clean.stdout and "tp 0 pp 1" in clean.stdout, clean.stdout[:2000]
    assert "0 errors, 0 warnings, 0 info" in clean.stdout
    # WHEN stage 1's connector files its layer 1 as layer 0 (its offset within the stage), over stage 0's file
    fault = _check("--fault", "stage-offset")
    # THEN stage 0's load of each prompt is named: it got other K/V than it saved; the request and block named
    assert fault.returncode == 1, fault.stdout + fault.stderr[-3000:]
    errors = [line for line in fault.stdout.splitlines() if line.startswith(("ERROR", "WARNING", "INFO"))]
    assert {line.split()[1] for line in errors} == {"handoff/digest-mismatch"}, fault.stdout[-4000:]
    assert len({line.split("seq '")[1].split("'")[0] for line in errors}) == 3
    assert all(" block " in line for line in errors)
    lines = fault.stdout.splitlines()
    messages = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("ERROR")]
    assert all("tp0pp0" in m for m in messages), fault.stdout[-4000:]
