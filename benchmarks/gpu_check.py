"""The probes' CUDA and NVML paths, on a machine with a GPU: one short run, printed results.

    .venv/bin/python benchmarks/gpu_check.py             # about a minute (tiny model on the GPU)
    .venv/bin/python benchmarks/gpu_check.py --smollm2   # also the decode overhead with SmolLM2 on the GPU

Sections: NVML per device and for this process; torch.cuda allocated/reserved around a
256 MiB allocation, compared with NVML's per-process figure; the engine on CUDA with its
pinned host arena, probes attached, blocks swapped out and back (mem events printed);
the cost of one reading with NVML; ``kvdoctor doctor``'s view. A failing section prints
its error and the others still run; the exit status is the number of failed sections.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20


def section(name: str, fn: Callable[[], Any], failures: list[str]) -> None:
    print(f"\n== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        out = fn()
        if out is not None:
            print(json.dumps(out, indent=1, default=str))
    except Exception:
        failures.append(name)
        traceback.print_exc(file=sys.stdout)
    print(f"-- {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def nvml_section() -> dict[str, Any]:
    from kvdoctor.probes.nvml import Nvml

    nvml = Nvml()
    try:
        if not nvml.available:
            return {"available": False, "reason": nvml.reason}
        reading = nvml.read()
        return {"available": True, "driver": nvml.driver_version, "pid": os.getpid(),
                "devices": [d.__dict__ for d in reading.devices], "process_used": reading.process_used}
    finally:
        nvml.close()


def cuda_section() -> dict[str, Any]:
    import torch

    from kvdoctor.probes.nvml import Nvml
    from kvdoctor.probes.torch_mem import CudaAllocator

    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    torch.cuda.init()
    allocator, nvml = CudaAllocator(), Nvml()
    before = allocator.read()
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    during, nvml_during = allocator.read(), nvml.read()
    del x
    torch.cuda.synchronize()
    after = allocator.read()
    out = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
        "allocated_MiB": [r.total_allocated / MiB for r in (before, during, after)],
        "reserved_MiB": [r.total_reserved / MiB for r in (before, during, after)],
        "nvml_process_used_MiB": None if nvml_during is None or nvml_during.process_used is None
        else nvml_during.process_used / MiB,
        "context_and_other_MiB (nvml process - torch reserved)": None
        if nvml_during is None or nvml_during.process_used is None
        else (nvml_during.process_used - during.total_reserved) / MiB,
    }
    assert during.total_allocated - before.total_allocated >= 256 * MiB, out
    nvml.close()
    return out


def engine_section(device: str = "cuda") -> dict[str, Any]:
    import torch

    from kvdoctor.engine.model.model import tiny_llama
    from kvdoctor.engine.serving.runner import Runner
    from kvdoctor.events import Mem
    from kvdoctor.probes import attach_to_cache

    model = tiny_llama(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, vocab_size=512).model.to(device)
    runner = Runner.create(model, device_blocks=12, host_blocks=256, block_size=16)
    mems: list[Mem] = []
    runner.bus.subscribe(lambda events: mems.extend(e for e in events if type(e) is Mem))
    prober = attach_to_cache(runner.cache, interval_s=0.05)
    host = runner.cache.arenas["host"]
    t0 = time.perf_counter()
    # 8 prompts of 64 tokens need more blocks than the device tier holds: swaps to the pinned host arena
    gens = runner.generate([[1, *range(10 + i, 73 + i)] for i in range(8)], max_new_tokens=32, max_batch=4)
    elapsed = time.perf_counter() - t0
    stats = runner.cache.stats()
    last = prober.take().to_dict()
    prober.detach()
    runner.close()
    assert mems, "no mem events"
    if device.startswith("cuda"):
        assert all(m.gpu_reserved is not None for m in mems[1:]), "no GPU figures in mem events"
    return {
        "generated_tokens": sum(len(g.token_ids) for g in gens), "seconds": elapsed,
        "host_arena_pinned": bool(host.pin), "swaps": stats["swaps"],
        "num_mem_events": len(mems), "first_mem": mems[0], "last_mem": mems[-1],
        "reading_detail": last, "cuda_allocated_now_MiB": torch.cuda.memory_allocated() / MiB if device.startswith("cuda") else None,
    }


def reading_cost_section() -> dict[str, Any]:
    import torch

    from kvdoctor.probes.nvml import Nvml
    from kvdoctor.probes.prober import Prober

    class NullBus:
        def emit(self, *_: Any, **__: Any) -> None:
            pass

    torch.cuda.init()
    nvml, prober = Nvml(), Prober(NullBus(), lambda: {"device": 1, "host": 1})
    out = {}
    for name, fn in (("nvml.read (all devices, per process)", nvml.read), ("Prober.take", prober.take)):
        fn()
        t0 = time.perf_counter_ns()
        for _ in range(200):
            fn()
        out[f"{name} us"] = (time.perf_counter_ns() - t0) / 200 / 1e3
    nvml.close()
    prober.close()
    return out


def doctor_section() -> list[dict[str, Any]]:
    from kvdoctor.probes.machine import inspect_machine

    return [{"name": i.name, "ok": i.ok, "summary": i.summary, "fix": i.fix} for i in inspect_machine()]


def smollm2_section() -> dict[str, Any]:
    import subprocess

    done = subprocess.run([sys.executable, str(Path(__file__).with_name("probes.py")), "--device", "cuda",
                           "--rounds", "3", "--tokens", "64", "--json"], capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", action="store_true", help="also measure decode overhead with SmolLM2 on the GPU")
    args = ap.parse_args()
    failures: list[str] = []
    section("nvml", nvml_section, failures)
    section("torch.cuda allocator vs NVML", cuda_section, failures)
    section("engine on CUDA: pinned host arena, swaps, mem events", engine_section, failures)
    section("cost of one reading", reading_cost_section, failures)
    section("kvdoctor doctor", doctor_section, failures)
    if args.smollm2:
        section("SmolLM2 decode, probes off/on", smollm2_section, failures)
    print(f"\nfailed sections: {failures or 'none'}")
    return len(failures)


if __name__ == "__main__":
    sys.exit(main())
