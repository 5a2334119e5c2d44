"""``kvdoctor check -- python EXAMPLE`` on one of examples/, as a user runs it, for the vLLM example tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def check_example(script: str, *example_args: str, **environ: str) -> subprocess.CompletedProcess:
    """The check's output. Each vLLM engine core runs in a process of its own, as vLLM runs by default (the
    other vLLM tests here run it in-process, where the plugin traces the process's first scheduler only)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", **environ)
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", "check", "--", sys.executable, script, *example_args],
                          cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
