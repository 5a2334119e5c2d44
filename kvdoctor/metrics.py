"""A Prometheus endpoint for live use: the cache's state and the checks' findings as metrics.

``kvdoctor check --follow --metrics-port N`` (headless, beside a serving process) and
``kvdoctor watch --metrics-port N`` feed every event and every finding to ``CacheMetrics``,
which keeps its own registry (never the process-wide default, so two sessions in one process
do not collide) and serves it on 127.0.0.1 only: the numbers describe someone's workload and
are not for the network unless they put a proxy in front.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .errors import UsageError
from .events import Alloc, Evict, Free, Prefetch, Read, Share, StepEnd, SwapIn, SwapOut, Usage
from .findings import Finding

__all__ = ["CacheMetrics", "MeteredChecker", "metered"]

_HOST = "127.0.0.1"
# events/s is a rate over this window, so a quiet second after a burst reads as quiet
_RATE_WINDOW_S = 5.0


class CacheMetrics:
    """Prometheus metrics updated from events (``observe``) and findings (``add_findings``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.blocks = Gauge("kvdoctor_blocks", "KV blocks in use per tier (last usage reading)", ["tier"], registry=r)
        self.capacity = Gauge("kvdoctor_capacity_blocks", "KV block capacity per tier", ["tier"], registry=r)
        self.kv_bytes = Gauge("kvdoctor_kv_bytes", "KV bytes in use per tier (last usage reading)", ["tier"], registry=r)
        self.swaps = Counter("kvdoctor_swaps", "blocks moved between tiers", ["direction", "src", "dst"], registry=r)
        self.prefetched = Counter("kvdoctor_prefetched_blocks", "blocks prefetched ahead of a read", registry=r)
        self.prefetch_hit_rate = Gauge(
            "kvdoctor_prefetch_hit_rate", "share of prefetched blocks read before anything else moved them", registry=r)
        self.prefix_hit_rate = Gauge(
            "kvdoctor_prefix_hit_rate", "share of blocks a sequence got by sharing (prefix cache, fork) over all it got",
            registry=r)
        self.findings = Counter("kvdoctor_findings", "findings of the checks", ["check", "rule", "severity"], registry=r)
        self.events = Counter("kvdoctor_events", "events judged", registry=r)
        self.events_per_s = Gauge("kvdoctor_events_per_second", f"events per second over the last {_RATE_WINDOW_S:g} s",
                                  registry=r)
        self.step = Gauge("kvdoctor_step", "last engine step seen", registry=r)
        self._num_allocs = self._num_shares = 0
        self._waiting: set[int] = set()  # prefetched blocks not yet read
        self._num_prefetched = self._num_prefetch_hits = 0
        self._window: list[tuple[float, int]] = []
        self._num_events = self._counted = 0  # events seen; of them, added to the counter so far

    def observe(self, event: Any) -> None:
        kind = type(event)
        self._num_events += 1
        if kind is Usage:
            self.blocks.labels(event.tier).set(event.used_blocks)
            self.capacity.labels(event.tier).set(event.capacity_blocks)
            if event.bytes is not None:
                self.kv_bytes.labels(event.tier).set(event.bytes)
        elif kind is SwapOut or kind is SwapIn:
            self.swaps.labels("out" if kind is SwapOut else "in", event.src, event.dst).inc()
            self._waiting.discard(event.block)
        elif kind is Prefetch:
            self.prefetched.inc(len(event.blocks))
            self._num_prefetched += len(event.blocks)
            self._waiting.update(event.blocks)
        elif kind is Read and self._waiting:
            hits = self._waiting.intersection(event.blocks)
            if hits:
                self._num_prefetch_hits += len(hits)
                self._waiting -= hits
        elif kind is Free or kind is Evict:
            if self._waiting:
                self._waiting.discard(event.block)  # prefetched, never read: a miss that must not stay forever
        elif kind is Alloc:
            self._num_allocs += 1
        elif kind is Share:
            self._num_shares += 1
        elif kind is StepEnd:
            self._end_step(event.step)

    def _end_step(self, step: int) -> None:
        """Rates are set once per step: cheap enough for every event, and what a scrape sees is whole."""
        self.step.set(step)
        self.events.inc(self._num_events - self._counted)
        self._counted = self._num_events
        if self._num_prefetched:
            self.prefetch_hit_rate.set(self._num_prefetch_hits / self._num_prefetched)
        if self._num_allocs + self._num_shares:
            self.prefix_hit_rate.set(self._num_shares / (self._num_allocs + self._num_shares))
        now = time.monotonic()
        self._window.append((now, self._num_events))
        while len(self._window) > 2 and now - self._window[0][0] > _RATE_WINDOW_S:
            self._window.pop(0)
        (t0, n0) = self._window[0]
        if now > t0:
            self.events_per_s.set((self._num_events - n0) / (now - t0))

    def add_findings(self, findings: Iterable[Finding]) -> None:
        for f in findings:
            self.findings.labels(f.check, f.rule, f.severity).inc()

    def serve(self, port: int) -> None:
        """Serve ``/metrics`` on 127.0.0.1:``port`` from a daemon thread; a taken port is a usage error."""
        try:
            start_http_server(port, addr=_HOST, registry=self.registry)
        except OSError as exc:
            raise UsageError(f"cannot serve metrics on {_HOST}:{port}: {exc.strerror or exc}; "
                             "choose another --metrics-port") from None


class MeteredChecker:
    """A checker (anything with ``observe``/``finish``) whose events and findings also feed metrics."""

    def __init__(self, checker: Any, metrics: CacheMetrics) -> None:
        self._checker = checker
        self._metrics = metrics

    def observe(self, event: Any) -> Any:
        self._metrics.observe(event)
        found = self._checker.observe(event)
        if found:
            self._metrics.add_findings(found)
        return found

    def finish(self) -> Any:
        found = self._checker.finish()
        if found:
            self._metrics.add_findings(found)
        return found


def metered(factory: Callable[[Any], Any], metrics: CacheMetrics) -> Callable[[Any], Any]:
    """A checker factory (the TUI feed's) whose checkers also feed ``metrics``."""

    def make(header: Any) -> Any:
        checker = factory(header)
        return None if checker is None else MeteredChecker(checker, metrics)

    return make
