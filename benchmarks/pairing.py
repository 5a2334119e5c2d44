"""How the benchmarks time decoding and compare two sides: shared by the decode, event-cost and vLLM benchmarks.

Decode tokens/s counts the tokens generated after the first one, over the time after the first token (prefill
excluded), by the wall clock and by this process's CPU time. Two sides run alternately (ABBA) and the report is
the median of the per-pair ratios with its quartiles: on a shared machine a burst of load hits one pair, not the
figure.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

TEXT = (
    "The history of computing is a story of layers: transistors make gates, gates make adders and memories, "
    "memories and adders make processors, and processors run the programs that people write to solve problems "
    "in science, business and daily life. Each layer hides the details of the one below it, which lets engineers "
    "build large systems without keeping every detail in mind at once. Caches are a good example of this idea."
)


def prompts_of(tokenizer: Any, lengths: list[int]) -> list[list[int]]:
    ids = tokenizer(TEXT)["input_ids"]
    while len(ids) < max(lengths):
        ids = ids + ids
    return [ids[:n] for n in lengths]


def clocks() -> tuple[float, float]:
    """(wall, CPU) seconds. CPU time of this process is the fairer clock on a shared machine with
    one torch thread: it does not count the time other processes held the core. On a GPU the clock first
    waits for the queued kernels, so a reading covers the work and not only its launch."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def rates(tokens: int, start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = clocks()
    return tokens / (wall - start[0]), tokens / (cpu - start[1])


def prefilled(runner: Any, prompts: list[list[int]], new_tokens: int | list[int]) -> Any:
    """A scheduler serving ``prompts`` in one batch to ``new_tokens`` each (one count, or one a prompt) whatever
    they generate, after its first step: every prompt's prefill and first token, so what follows is decode."""
    from kvdoctor.engine.serving.scheduler import Request, Scheduler

    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    sched = Scheduler(runner, max_batch=len(prompts))
    for p, n in zip(prompts, counts):
        sched.submit(Request(p, max_new_tokens=n, ignore_eos=True))
    sched.step()
    return sched


def runner_decode(runner: Any, prompts: list[list[int]], new_tokens: list[int]) -> tuple[float, float]:
    """Decode tokens/s (wall, CPU) of the runner with continuous batching over the unpadded prompts."""
    sched = prefilled(runner, prompts, new_tokens)
    t0 = clocks()
    sched.run()
    measured = rates(sum(n - 1 for n in new_tokens), t0)
    assert sorted(len(g.token_ids) for g in sched.done.values()) == sorted(new_tokens)
    return measured


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def paired(a: Callable[[], tuple[float, float]], b: Callable[[], tuple[float, float]], pairs: int
           ) -> dict[str, Any]:
    """Run ``a`` and ``b`` alternately ``pairs`` times (ABBA order, so a drift in machine load hits both
    alike) and compare them pair by pair: the median of the per-pair ratios b/a of tokens/s, by wall
    clock and by CPU time, is robust to the bursts of load a shared machine has; quartiles show the noise."""
    runs: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    for i in range(pairs):
        order = (("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))
        for name, fn in order:
            runs[name].append(fn())
    out: dict[str, Any] = {}
    for clock, j in (("wall", 0), ("cpu", 1)):
        ratios = [rb[j] / ra[j] for ra, rb in zip(runs["a"], runs["b"])]
        lo, hi = quartiles(ratios)
        out[clock] = {"a": round(median([r[j] for r in runs["a"]]), 2), "b": round(median([r[j] for r in runs["b"]]), 2),
                      "ratio": round(median(ratios), 4), "ratio_q1": round(lo, 4), "ratio_q3": round(hi, 4)}
    return out
