"""Helpers shared by the probe tests: a child Python workload whose stacks py-spy can dump."""

import subprocess
import sys
import textwrap

import pytest

from kvdoctor.probes.pyspy import PySpyError, dump_stacks, let_parent_trace

WORKLOAD = textwrap.dedent("""
    import time

    def decode_forever():
        print("ready", flush=True)
        while True:
            time.sleep(0.05)

    decode_forever()
""")


@pytest.fixture
def child_workload(tmp_path):
    """A running child Python process parked in ``decode_forever``; killed afterwards."""
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             preexec_fn=let_parent_trace())  # as kvdoctor starts workloads
    assert child.stdout.readline().strip() == "ready"
    yield child
    child.kill()
    child.wait()


@pytest.fixture
def ptrace_permitted(child_workload):
    """Skip, saying why, where this machine does not let py-spy read a child process."""
    try:
        dump_stacks(child_workload.pid, timeout_s=20)
    except PySpyError as exc:
        pytest.skip(f"py-spy cannot read a child process here: {exc}")
    return child_workload
