"""A traced workload SIGKILLed at random moments: what tests/foundation/test_killed_writer.py checks.

One warm process imports torch and loads the model once, then for each cut forks a child that
serves requests on kvdoctor's engine with ``KVDOCTOR_TRACE`` (and the memory probes) on, and
kills it with SIGKILL a random time after its trace appeared. The child tells the parent, over a
pipe, how many engine steps it had completed, so the test knows what the trace must hold.
Forking keeps a cut at milliseconds instead of an interpreter start with torch (seconds).

    python tests/killed_writer.py --model tiny --cuts 20 --seed 0 --span 0.4 --from-first-step 0.75 --out DIR

prints one JSON object per cut: ``{"trace": path, "completed": steps, "moment": seconds, "serving": bool}``
(serving: the moment counted from the first completed step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import time


def serve(lm, seed: int, *, trace: str | None = None, report_fd: int | None = None, steps: int | None = None) -> None:
    """Serve random requests on a small device tier (so blocks swap), reporting every completed step to
    ``report_fd``: forever in a child that writes ``trace``; for ``steps`` steps in the parent, untraced,
    to warm it (a process's first steps and first swaps pay one-time costs, up to ~0.4 s on a busy machine,
    which every forked child would otherwise pay again, leaving few cuts while the engine swaps)."""
    from kvdoctor.engine.serving.runner import Runner, SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler

    if trace is not None:
        os.environ.update(KVDOCTOR_TRACE=trace, KVDOCTOR_PROBES="1", KVDOCTOR_PROBES_INTERVAL="0.01")
    runner = Runner.create(lm.model, tokenizer=lm.tokenizer, block_size=16, device_blocks=12, host_blocks=256,
                           extra={"model": lm.name})
    sched = Scheduler(runner, max_batch=6)
    rng = random.Random(seed)
    vocab = lm.config.vocab_size
    completed = 0
    while steps is None or completed < steps:
        while len(sched.live) < 6:
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 48))]
            sched.submit(Request(ids, max_new_tokens=rng.randint(4, 32),
                                 sampling=SamplingParams(greedy=False, seed=rng.randrange(1 << 30))))
        sched.step()
        completed += 1
        if report_fd is not None:
            os.write(report_fd, struct.pack("<I", completed))
    runner.close()


def cut(lm, trace: str, moment: float, seed: int, *, from_first_step: bool = False) -> int:
    """Fork a serving child, SIGKILL it ``moment`` s after its trace appeared (or after its first step
    completed: a large model's start-up would take most moments); the steps it completed."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        try:
            serve(lm, seed, trace=trace, report_fd=write_end)
        finally:
            os._exit(1)
    os.close(write_end)
    reports = b""
    if from_first_step:
        reports = os.read(read_end, 4)
    deadline = time.monotonic() + 60
    while not os.path.exists(trace) or os.path.getsize(trace) == 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.001)
    time.sleep(moment)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while chunk := os.read(read_end, 1 << 16):
        reports += chunk
    os.close(read_end)
    return struct.unpack_from("<I", reports, len(reports) - 4)[0] if len(reports) >= 4 else 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny", help="'tiny' or 'smollm2' (the embedded model)")
    p.add_argument("--cuts", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--span", type=float, default=0.6, help="moments are uniform in [0, span) s after the trace appears")
    p.add_argument("--from-first-step", type=float, default=0.0, metavar="SHARE",
                   help="the share of cuts whose moment counts from the first completed step, not from the "
                   "trace's appearance (a busy machine or a large model can take the whole span to start)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)  # a forked child must not inherit a thread pool it cannot use
    from kvdoctor.engine.model.model import load_model, tiny_llama

    lm = tiny_llama(num_layers=2, max_position_embeddings=2048) if a.model == "tiny" else load_model(None)
    serve(lm, a.seed, steps=40)
    rng = random.Random(a.seed)
    for i in range(a.cuts):
        trace = os.path.join(a.out, f"cut{i:02d}.kvtrace")
        moment = rng.uniform(0, a.span)
        serving = rng.random() < a.from_first_step
        completed = cut(lm, trace, moment, seed=rng.randrange(1 << 30), from_first_step=serving)
        print(json.dumps({"trace": trace, "completed": completed, "moment": round(moment, 4), "serving": serving}),
              flush=True)


if __name__ == "__main__":
    main()
