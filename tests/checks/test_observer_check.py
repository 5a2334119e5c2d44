"""The observer check: kvdoctor's own producer lost track of its host. The run fails on that, and
nothing the incomplete trace shows after it is judged (what it misses would read as leaks)."""

from __future__ import annotations

from tracebuilder import rules

from kvdoctor.events import ObserverError


def _lost(trace, part="BlockPool.touch"):
    return trace._emit(ObserverError, producer="vllm", part=part, error="KeyError", message="17",
                       where="kvdoctor/integrations/vllm.py:210")


def test_an_observer_error_is_one_error_naming_the_host_method_and_where_kvdoctor_failed(trace):
    # GIVEN a clean start, then the producer fails in its bookkeeping of BlockPool.touch
    trace.sequence_with_blocks("r1", 1)
    trace.end_step()
    _lost(trace)
    findings = trace.run()
    # THEN one error says kvdoctor lost track, where, and that the host went on
    assert rules(findings) == ["observer/lost-track"]
    (f,) = findings
    assert f.severity == "error" and f.step == 1
    assert "kvdoctor lost track of vllm in BlockPool.touch at step 1" in f.message
    assert "kvdoctor/integrations/vllm.py:210" in f.message and f.evidence["part"] == "BlockPool.touch"


def test_what_the_trace_left_unfinished_at_the_loss_is_not_judged(trace):
    # GIVEN a sequence that ended with a block released but not yet freed when the producer failed
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.release(b0, "r1")
    trace.end("r1")
    _lost(trace)
    trace.end_step()
    # WHEN the trace ends there
    findings = trace.run()
    # THEN neither the end of the step nor the end of the trace call the block a leak
    assert rules(findings) == ["observer/lost-track"]


def test_the_same_block_left_unfreed_without_a_loss_is_a_leak(trace):
    # near miss: the same trace, no observer_error
    (b0,) = trace.sequence_with_blocks("r1", 1)
    trace.release(b0, "r1")
    trace.end("r1")
    trace.end_step()
    assert "leak/unreachable" in rules(trace.run())
