"""What events cost a decode step: the decode benchmark's event, sink and digest measurements (run by
``benchmarks/decode.py``; see its docstring for what each reports)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any, Callable, Iterator

import torch

from pairing import clocks, median, paired, prefilled, quartiles, runner_decode

def events_by_step(runner: Any, sink: Callable[[list[Any]], None], prompts: list[list[int]], new_tokens: int
                   ) -> dict[str, list[float]]:
    """Seconds per decode step (wall, CPU) with events off and with ``sink`` listening, alternating step
    by step in one continuous batch (off, on, on, off, …): each pair compares two neighbouring steps of
    the same batch, so machine load and the growing context hit both sides alike."""
    sched = prefilled(runner, prompts, new_tokens)
    times: dict[str, list[float]] = {"off_wall": [], "off_cpu": [], "on_wall": [], "on_cpu": []}
    i = 0
    while len(sched.done) < len(prompts):
        on = i % 4 in (1, 2)
        wall, cpu = _timed_step(runner, sched, sink if on else None)
        side = "on" if on else "off"
        times[f"{side}_wall"].append(wall)
        times[f"{side}_cpu"].append(cpu)
        i += 1
    n = min(len(times["off_cpu"]), len(times["on_cpu"]))
    return {k: v[:n] for k, v in times.items()}


def _timed_step(runner: Any, sched: Any, sink: Callable[[list[Any]], None] | None) -> tuple[float, float]:
    """(wall, CPU) seconds of one scheduler step, with ``sink`` listening (None: nobody listens). A listened
    step ends by handing its events to the sink, so the sink's work is inside the step's time."""
    if sink is not None:
        runner.bus.subscribe(sink)
    w0, c0 = clocks()
    sched.step()
    if sink is not None:
        runner.bus.unsubscribe(sink)
    w1, c1 = clocks()
    return w1 - w0, c1 - c0


def sink_split(runner: Any, sinks: dict[str, Callable[[list[Any]], None]], prompts: list[list[int]], new_tokens: int,
               runs: int) -> dict[str, Any]:
    """The extra time of a step listened by each of ``sinks`` over an unlistened step, in cycles of one
    unlistened step and one step per sink (the sinks' order rotating cycle by cycle, so none always follows
    the unlistened step): a sink that discards the events measures what producing them costs the engine,
    a trace writer what writing them adds. Medians of each sink's step minus its cycle's unlistened step,
    with quartiles; a step's spread on a shared machine needs hundreds of cycles to resolve 0.5%."""
    names = list(sinks)
    extra: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in names}
    off: dict[str, list[float]] = {"wall": [], "cpu": []}
    cycles = 0
    for _ in range(runs):
        sched = prefilled(runner, prompts, new_tokens)
        while sched.live:
            base = _timed_step(runner, sched, None)
            steps = []
            for name in names[cycles % len(names):] + names[: cycles % len(names)]:
                if sched.live:
                    steps.append((name, _timed_step(runner, sched, sinks[name])))
            if len(steps) < len(names):
                break  # the batch ended inside the cycle: an incomplete cycle is left out
            for j, clock in enumerate(("wall", "cpu")):
                off[clock].append(base[j])
                for name, times in steps:
                    extra[name][clock].append(times[j] - base[j])
            cycles += 1
    out: dict[str, Any] = {"cycles": cycles}
    for clock in ("wall", "cpu"):
        step = median(off[clock])
        out[clock] = {"off_ms": round(1e3 * step, 2)}
        for name in names:
            mid, (lo, hi) = median(extra[name][clock]), quartiles(extra[name][clock])
            out[clock][name] = {"extra_ms": round(1e3 * mid, 3), "share": round(mid / step, 4),
                                "share_q1": round(lo / step, 4), "share_q3": round(hi / step, 4)}
    return out


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` for the block, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@contextlib.contextmanager
def compiled_events(on: bool) -> Iterator[None]:
    """Attention statistics and digest unit sums by their compiled passes (``on``), or by the torch and
    numpy passes they replaced: the baseline of ``--compiled-events both``."""
    from kvdoctor.engine.kv import digest
    from kvdoctor.engine.model import attention

    saved = attention._stats_kernel, digest._sums_kernel
    if not on:
        attention._stats_kernel = digest._sums_kernel = lambda: None
    try:
        yield
    finally:
        attention._stats_kernel, digest._sums_kernel = saved


class _Timers:
    """Wall-clock seconds spent inside chosen methods, per label, while in effect: each method is wrapped
    on its instance (``targets``: label -> [(object, method name)]) and the wrapper's own cost subtracted.

    The wall clock is a vDSO read (~50 ns): the process CPU clock is a system call whose own cost, several
    times a timed call's, would swamp it; a section preempted by another process only inflates the figure."""

    def __init__(self, targets: dict[str, list[tuple[Any, str]]]) -> None:
        self.targets = targets
        self.reset()
        label = next(iter(targets))
        probe = self._wrap(lambda: None, label)  # what the timer itself adds to each interval
        for _ in range(20000):
            probe()
        self.per_call = self.spent[label] / self.calls[label]
        self.reset()

    def _wrap(self, f: Callable[..., Any], label: str) -> Callable[..., Any]:
        def g(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.spent[label] += time.perf_counter() - t0
                self.calls[label] += 1
        return g

    def reset(self) -> None:
        self.spent = dict.fromkeys(self.targets, 0.0)
        self.calls = dict.fromkeys(self.targets, 0)

    def inside(self, label: str) -> float:
        """Seconds inside ``label``'s methods since the last reset, less the timers' own share."""
        return max(self.spent[label] - self.calls[label] * self.per_call, 0.0)

    def __enter__(self) -> _Timers:
        for label, methods in self.targets.items():
            for o, n in methods:
                setattr(o, n, self._wrap(getattr(o, n), label))
        return self

    def __exit__(self, *exc: object) -> None:
        for methods in self.targets.values():
            for o, n in methods:
                delattr(o, n)  # the instance attribute goes; the class's method shows again


def _listened_decode(runner: Any, sink: Callable[[list[Any]], None], prompts: list[list[int]], new_tokens: int,
                     timers: _Timers, each_step: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """Decode ``prompts`` with ``sink`` listening, ``timers`` reset after the prefill; decode steps and seconds."""
    runner.bus.subscribe(sink)
    try:
        sched = prefilled(runner, prompts, new_tokens)
        timers.reset()
        steps, t0 = 0, time.perf_counter()
        while sched.live:
            sched.step()
            each_step()
            steps += 1
        return steps, time.perf_counter() - t0
    finally:
        runner.bus.unsubscribe(sink)


def digest_share(runner: Any, sink: Callable[[list[Any]], None], prompts: list[list[int]], new_tokens: int,
                 mode: str) -> dict[str, Any]:
    """Time inside the digest code per decode step, and its share of the step, with every event on."""
    book = runner.cache.digests
    before = book.mode
    book.mode = mode
    try:
        with _Timers({"digest": [(book, "stage"), (book, "stage_units"), (book, "record_write"), (book, "verify"),
                                 (book, "retake")]}) as t:
            steps, total = _listened_decode(runner, sink, prompts, new_tokens, t)
    finally:
        book.mode = before
    inside = t.inside("digest")
    return {"steps": steps, "step_ms": round(1e3 * total / steps, 2), "digest_ms": round(1e3 * inside / steps, 3),
            "share": round(inside / total, 4), "calls_per_step": round(t.calls["digest"] / steps, 1)}


def event_parts(runner: Any, sink: Callable[[list[Any]], None], prompts: list[list[int]], new_tokens: int
                ) -> dict[str, float]:
    """Milliseconds a listened decode step spends inside each part of the event path (medians over the
    steps): attention statistics and their events, staging the written K/V for digests, booking writes
    (digest fold and records), read events (and sampled verification), and the step's end (the sink)."""
    cache = runner.cache
    targets = {"stats": [(runner, "_emit_stats")],
               "stage": [(cache.digests, "stage"), (cache.digests, "stage_units")],
               "writes": [(cache.digests, "record_write")], "reads": [(cache, "emit_read")],
               "step_end": [(runner.bus, "end_step")]}
    per_step: dict[str, list[float]] = {label: [] for label in [*targets, "total"]}

    def note() -> None:
        for label in targets:
            per_step[label].append(t.inside(label))
        per_step["total"].append(sum(t.inside(label) for label in targets))
        t.reset()

    with _Timers(targets) as t:
        _listened_decode(runner, sink, prompts, new_tokens, t, note)
    return {label: round(1e3 * median(v), 3) for label, v in per_step.items()}


def digests_paired(runner: Any, sink: Callable[[list[Any]], None], prompts: list[list[int]], new_tokens: int,
                   mode: str, pairs: int) -> dict[str, Any]:
    """Whole decode runs with every event on, content digests off (a) against ``mode`` (b), ABBA."""

    def with_mode(m: str) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            runner.cache.digests.mode = m
            runner.bus.subscribe(sink)
            try:
                return runner_decode(runner, prompts, [new_tokens] * len(prompts))
            finally:
                runner.bus.unsubscribe(sink)
        return run

    before = runner.cache.digests.mode
    try:
        out = paired(with_mode("off"), with_mode(mode), pairs)
    finally:
        runner.cache.digests.mode = before
    # tokens/s ratio b/a -> extra time per token of b
    return {clock: {"off_tok_s": v["a"], f"{mode}_tok_s": v["b"], "overhead": round(1 / v["ratio"] - 1, 4),
                    "overhead_q1": round(1 / v["ratio_q3"] - 1, 4), "overhead_q3": round(1 / v["ratio_q1"] - 1, 4)}
            for clock, v in out.items()}
