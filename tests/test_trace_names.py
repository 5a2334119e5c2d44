"""kvdoctor.trace_names: every trace of a run beside the first, never over another writer's."""

from __future__ import annotations

import os
import subprocess
import sys

from kvdoctor.trace_names import claim, numbered


def test_a_previous_runs_trace_is_replaced_and_this_runs_traces_are_numbered(tmp_path):
    path = str(tmp_path / "run.kvtrace")
    assert [numbered(path, n).rsplit("/", 1)[1] for n in (1, 2, 10)] == ["run.kvtrace", "run.2.kvtrace",
                                                                         "run.10.kvtrace"]
    assert numbered(str(tmp_path / "run.kvtrace.gz"), 3).endswith("run.3.kvtrace.gz")
    # GIVEN a trace a previous run left (older than this run)
    (tmp_path / "run.kvtrace").write_text("")
    os.utime(path, (1, 1))
    # THEN this run takes its place, as a re-run replaces its own trace
    assert claim(path) == (path, 1)
    # AND once this run wrote it (and a second), the next writer of the run goes beside them
    (tmp_path / "run.kvtrace").write_text("")
    (tmp_path / "run.2.kvtrace").write_text("")
    assert claim(path) == (str(tmp_path / "run.3.kvtrace"), 3)


def test_two_processes_of_one_run_write_two_traces(tmp_path):
    # GIVEN a workload whose two child processes (one process group) each build a kvdoctor cache
    child = ("import tempfile\nfrom kvdoctor.engine import EngineConfig, PagedKVCache\n"
             "c = PagedKVCache(EngineConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype='float32', "
             "device_blocks=4, host_blocks=0, disk_blocks=0, disk_dir=tempfile.mkdtemp()))\n"
             "c.add_sequence('a', prompt_len=1)\nc.end_step()\nc.close()\n")
    parent = (f"import subprocess, sys\nfor _ in range(2):\n"
              f"    subprocess.run([sys.executable, '-c', {child!r}], check=True)\n")
    env = dict(os.environ, KVDOCTOR_TRACE=str(tmp_path / "run.kvtrace"))
    subprocess.run([sys.executable, "-c", parent], env=env, check=True, start_new_session=True, timeout=120)
    # THEN the second process wrote beside the first instead of over it
    assert sorted(p.name for p in tmp_path.glob("*.kvtrace")) == ["run.2.kvtrace", "run.kvtrace"]
