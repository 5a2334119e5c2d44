"""A child workload gets memory probes from the environment, through the engine's hook."""

import os
import subprocess
import sys
import textwrap

from kvdoctor.events import Mem, StepEnd
from kvdoctor.trace import TraceReader

WORKLOAD = textwrap.dedent("""
    from kvdoctor.engine.model.model import tiny_llama
    from kvdoctor.engine.serving.runner import Runner

    runner = Runner.create(tiny_llama().model, device_blocks=32, host_blocks=32, block_size=4)
    runner.generate([[1, 5, 6, 7, 8, 9], [1, 10, 11]], max_new_tokens=12)
    runner.close()
""")


def _run(tmp_path, **env):
    trace = tmp_path / "run.kvtrace"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")} | {"KVDOCTOR_TRACE": str(trace), **env}
    subprocess.run([sys.executable, "-c", WORKLOAD], env=env, check=True, timeout=300)
    return list(TraceReader(trace))


def test_mem_events_are_in_the_trace_of_a_run_with_probes_on(tmp_path):
    probed_run = _run(tmp_path, KVDOCTOR_PROBES="1", KVDOCTOR_PROBES_INTERVAL="0.000001")
    # GIVEN a workload run with KVDOCTOR_TRACE and KVDOCTOR_PROBES=1 THEN its trace holds mem readings
    mems = [e for e in probed_run if isinstance(e, Mem)]
    assert mems[0].source == "start" and {m.source for m in mems[1:]} == {"interval"}
    # one per step boundary at this interval, each with the engine's own figures
    assert len(mems) >= sum(isinstance(e, StepEnd) for e in probed_run)
    assert max(m.kv_bytes for m in mems) > 0
    assert all(m.rss > m.torch_cpu > 0 and m.unaccounted == m.rss - m.torch_cpu for m in mems[1:])
    assert all(m.py_heap is None for m in mems)  # tracemalloc only when KVDOCTOR_PROBES_HEAP=1

