"""The user's line behind a vLLM request, carried from the process that added it to the engine core's trace.

vLLM's scheduler, which the plugin traces, runs in an engine-core process of its own (V1 multiprocessing):
its frames are vLLM's busy loop, never the user's ``llm.generate(...)``. A request crosses over as an
``EngineCoreRequest`` whose ``trace_headers`` (OpenTelemetry's context: a str -> str map vLLM hands on as it
is) can carry one entry more. Where vLLM gives each request its id (``InputProcessor.assign_request_id``,
in ``LLMEngine`` and ``AsyncLLM`` alike), the plugin puts the user's frames under ``STACK_HEADER``; the
engine core's tracer reads them back onto the request's ``seq_start``. OpenTelemetry's propagators read only
their own keys, so the entry changes nothing for a user who traces requests.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .. import callsite

__all__ = ["STACK_HEADER", "carry_stacks", "stack_of"]

STACK_HEADER = "x-kvdoctor-stack"


def carry_stacks() -> None:
    """Make every request this process hands to vLLM's engine carry its user's frames. Never raises."""
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return
    if getattr(InputProcessor, "_kvdoctor_stacks", False):
        return
    assign = InputProcessor.__dict__.get("assign_request_id")
    original = assign.__func__ if isinstance(assign, staticmethod) else None
    if original is None:  # not the static method this was written against: leave vLLM as it is
        return
    failed: list[bool] = []

    def assign_request_id(request: Any) -> None:
        original(request)  # vLLM's own first: what it raises is the caller's to see
        if failed:
            return
        try:
            stack = callsite.user_stack()
            if stack:
                request.trace_headers = {**(request.trace_headers or {}), STACK_HEADER: json.dumps(stack)}
        except Exception as exc:  # the request goes on without the user's frames
            failed.append(True)
            print(f"kvdoctor: requests no longer carry the caller's stack ({type(exc).__name__}: {exc})",
                  file=sys.stderr)

    InputProcessor.assign_request_id = staticmethod(assign_request_id)
    InputProcessor._kvdoctor_stacks = True


def stack_of(request: Any) -> list[str] | None:
    """The frames ``carry_stacks`` put on ``request`` in the process that added it; None when it carries none."""
    headers = getattr(request, "trace_headers", None)
    raw = headers.get(STACK_HEADER) if isinstance(headers, dict) else None
    if not isinstance(raw, str):
        return None
    try:
        frames = json.loads(raw)
    except ValueError:
        return None
    return [str(f) for f in frames] if isinstance(frames, list) and frames else None
