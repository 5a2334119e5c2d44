"""py-spy dumps of a child workload, and a refusal explained with its fix."""

import os
import stat
import subprocess
import sys

import pytest

from kvdoctor.probes import pyspy
from kvdoctor.probes.pyspy import PtraceDenied, PySpyError, dump_stacks, ptrace_status


def test_dump_of_a_child_workload_shows_its_python_stack(ptrace_permitted):
    # GIVEN a child parked in decode_forever WHEN its stacks are dumped
    threads = dump_stacks(ptrace_permitted.pid, timeout_s=20)
    # THEN the main thread's frames name the function and the workload file
    frames = [f for t in threads for f in t.frames]
    assert any(f.startswith("decode_forever (") and "workload.py:" in f for f in frames)


def _fake_py_spy(tmp_path, stderr: str, code: int = 1) -> str:
    exe = tmp_path / "py-spy"
    exe.write_text(f"#!/bin/sh\ncat >&2 <<'END'\n{stderr}\nEND\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_permission_refusal_is_explained_with_its_fix(tmp_path, monkeypatch):
    # GIVEN a py-spy that the kernel refuses (what py-spy prints under ptrace_scope=2 or without SYS_PTRACE)
    fake = _fake_py_spy(tmp_path, "Error: Failed to suspend process\n\nCaused by:\n    Operation not permitted (os error 1)")
    monkeypatch.setattr(pyspy, "find_py_spy", lambda: fake)
    # WHEN a dump is asked for THEN the error names the pid and says how to allow ptrace
    with pytest.raises(PtraceDenied) as err:
        dump_stacks(4242)
    message = str(err.value)
    assert "4242" in message and "ptrace_scope" in message and "SYS_PTRACE" in message
    assert err.value.detail == "Error: Failed to suspend process"


def test_other_failures_are_py_spy_errors_with_its_message(tmp_path, monkeypatch):
    fake = _fake_py_spy(tmp_path, "Error: Failed to find python version from target process")
    monkeypatch.setattr(pyspy, "find_py_spy", lambda: fake)
    with pytest.raises(PySpyError) as err:
        dump_stacks(4242)
    assert not isinstance(err.value, PtraceDenied)
    assert "Failed to find python version" in str(err.value)


def test_a_dump_that_hangs_times_out(tmp_path, monkeypatch):
    exe = tmp_path / "py-spy"
    exe.write_text("#!/bin/sh\nexec sleep 30\n")
    exe.chmod(0o755)
    monkeypatch.setattr(pyspy, "find_py_spy", lambda: str(exe))
    with pytest.raises(PySpyError, match="did not answer within 0.5 s"):
        dump_stacks(4242, timeout_s=0.5)


def test_ptrace_status_describes_this_process():
    status = ptrace_status()
    assert status["euid"] == os.geteuid()
    assert status["ptrace_scope"] in (None, 0, 1, 2, 3)
    assert isinstance(status["may_attach_child"], bool)


def test_py_spy_is_found_beside_the_interpreter():
    assert os.access(pyspy.find_py_spy(), os.X_OK)


def test_parent_is_declared_tracer_only_under_ptrace_scope_1(monkeypatch):
    for scope, wanted in ((None, False), (0, False), (1, True), (2, False), (3, False)):
        monkeypatch.setattr(pyspy, "ptrace_status", lambda scope=scope: {"ptrace_scope": scope})
        assert (pyspy.let_parent_trace() is not None) is wanted
    # the declaration runs in the forked child before exec and never stops it from starting
    monkeypatch.setattr(pyspy, "ptrace_status", lambda: {"ptrace_scope": 1})
    subprocess.run([sys.executable, "-c", "pass"], preexec_fn=pyspy.let_parent_trace(), check=True)
