"""The vLLM tracer records the user's stack on a request's start and end, when vLLM's scheduler runs in the
user's own process (an in-process engine, or vLLM's own tests): the line that added or aborted it; and, when
the scheduler runs in an engine-core process of its own, the line that added it travels with the request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from kvdoctor.events import SeqEnd, SeqStart  # noqa: E402
from kvdoctor.findings import split_frame  # noqa: E402

from vllm_harness import make_harness  # noqa: E402

pytestmark = pytest.mark.vllm


def test_a_request_carries_the_lines_that_added_and_aborted_it(tmp_path):
    # GIVEN a traced scheduler driven from this test: one request aborted while running, one finished
    h = make_harness(tmp_path / "t.kvtrace", block_size=16, num_blocks=16)
    added = sys._getframe().f_lineno + 1
    h.request("r0", list(range(1, 40)), max_tokens=64)
    h.request("r1", list(range(1, 40)), max_tokens=2)
    h.run(until=lambda: h.scheduler.requests["r0"].num_computed_tokens > 0, max_steps=50)
    aborted = sys._getframe().f_lineno + 1
    h.abort("r0")
    h.run(until=lambda: not h.scheduler.has_requests(), max_steps=100)
    findings, events = h.findings()
    h.close()
    assert findings == []
    # THEN r0's seq_start names the line of this test that added it (under the harness's own frame, innermost),
    # and its seq_end the line that aborted it
    def lines_here(stack):
        return [line for path, line, _ in map(split_frame, stack or ()) if Path(path).name == Path(__file__).name]

    start = next(e for e in events if type(e) is SeqStart and e.seq == "r0")
    end = next(e for e in events if type(e) is SeqEnd and e.seq == "r0")
    assert Path(split_frame(start.stack[0])[0]).name == "vllm_harness.py"
    assert lines_here(start.stack) == [added]
    assert end.reason == "aborted" and lines_here(end.stack) == [aborted]


def test_a_request_carries_its_users_frames_to_an_engine_core_in_another_process():
    import types

    from vllm.v1.engine.input_processor import InputProcessor

    from kvdoctor.integrations.vllm_stacks import STACK_HEADER, carry_stacks, stack_of

    # GIVEN the plugin in the process that adds requests (the front end of a multiprocess LLM or server)
    carry_stacks()
    carry_stacks()  # a second plugin load patches nothing twice
    # WHEN vLLM gives a request its id there (a stand-in for the EngineCoreRequest it builds)
    request = types.SimpleNamespace(request_id="7", external_req_id=None, trace_headers={"traceparent": "00-x"})
    added = sys._getframe().f_lineno + 1
    InputProcessor.assign_request_id(request)
    # THEN vLLM's own id is assigned as before, the caller's OpenTelemetry context is kept beside the frames,
    # and the engine core reads back this test's line
    assert request.external_req_id == "7" and request.request_id.startswith("7-")
    assert request.trace_headers["traceparent"] == "00-x" and STACK_HEADER in request.trace_headers
    frames = stack_of(request)
    assert any(Path(split_frame(f)[0]).name == Path(__file__).name and split_frame(f)[1] == added for f in frames)
    # AND a request that carries none, or garbage, gives None rather than an error
    assert stack_of(types.SimpleNamespace(trace_headers=None)) is None
    assert stack_of(types.SimpleNamespace(trace_headers={STACK_HEADER: "not json"})) is None

