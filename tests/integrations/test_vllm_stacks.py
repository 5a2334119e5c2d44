"""The vLLM tracer records the user's stack on a request's start and end, when vLLM's scheduler runs in the
user's own process (an in-process engine, or vLLM's own tests): the line that added or aborted it."""

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
