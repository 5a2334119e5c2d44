"""A traced workload killed with SIGKILL at 20 random moments: every trace reads, holds every step
the workload completed (it loses at most the step in flight), and gives no finding at all, so
nothing the checks report can be caused by the cut. The workload is kvdoctor's engine serving
random requests on a small device tier (blocks swap to host) with the memory probes on;
tests/killed_writer.py forks it from one warm process per cut."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor.events import StepEnd, SwapOut
from kvdoctor.session import Session, TraceSource
from kvdoctor.trace import TraceReader

HARNESS = Path(__file__).parent.parent / "killed_writer.py"
NUM_CUTS = 20


@pytest.mark.parametrize("model, span, serving", [
    ("tiny", 0.4, 0.75),  # a quarter of the moments count from the trace's appearance: some fall before step 1
    pytest.param("smollm2", 3.0, 1.0, marks=pytest.mark.slow),  # its start-up takes seconds
])
def test_a_workload_killed_at_random_moments_leaves_whole_clean_traces(tmp_path, model, span, serving):
    # GIVEN a traced workload WHEN it is SIGKILLed at 20 random moments (one fresh workload per cut)
    done = subprocess.run([sys.executable, str(HARNESS), "--model", model, "--cuts", str(NUM_CUTS), "--seed", "17",
                           "--span", str(span), "--from-first-step", str(serving), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    cuts = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(cuts) == NUM_CUTS
    swaps = 0
    for c in cuts:
        # THEN each trace reads to its end (a line cut short would be a truncation, never an error)
        reader = TraceReader(c["trace"])
        events = [e for batch in reader.batches() for e in batch]
        steps = [e.step for e in events if type(e) is StepEnd]
        # AND it holds every step the workload completed, plus at most the one in flight
        assert c["completed"] <= len(steps) <= c["completed"] + 1, c
        assert steps == list(range(len(steps))), c
        in_flight = events[len(events) - next((i for i, e in enumerate(reversed(events)) if type(e) is StepEnd),
                                              len(events)):]
        assert {e.step for e in in_flight} <= {len(steps)}, c
        swaps += sum(type(e) is SwapOut for e in events)
        # AND the checks find nothing: a cut is no leak, no stale read, no misaligned batch
        findings = Session(TraceSource(c["trace"])).run().findings
        assert findings == [], (c, [f.message for f in findings])
    # AND the cuts landed while the engine served and swapped, not only before its first step
    assert sum(c["serving"] for c in cuts) >= NUM_CUTS // 2
    assert all(c["completed"] > 0 for c in cuts if c["serving"])
    assert swaps > 0
