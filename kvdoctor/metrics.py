"""A Prometheus endpoint for live use: the cache's state and the checks' findings as metrics.

``kvdoctor check --follow --metrics-port N`` (headless, beside a serving process) and
``kvdoctor watch --metrics-port N`` feed every event and every finding to ``CacheMetrics``,
which keeps its own registry (never the process-wide default, so two sessions in one process
do not collide) and serves it on 127.0.0.1 only: the numbers describe someone's workload and
are not for the network unless they put a proxy in front.

Following Prometheus's conventions, nothing here is a rate or a ratio a scrape would freeze: hit rates
are pairs of counters (hits and lookups, to divide in a query over any window), and events per second
is ``rate(kvdoctor_events_total[1m])``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .errors import UsageError
from .events import Alloc, Evict, Free, Prefetch, Read, Share, StepEnd, SwapIn, SwapOut, Usage
from .findings import Finding

__all__ = ["CacheMetrics", "MeteredChecker", "metered"]

_HOST = "127.0.0.1"


class CacheMetrics:
    """Prometheus metrics updated from events (``observe``) and findings (``add_findings``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.blocks = Gauge("kvdoctor_blocks", "KV blocks in use per tier (last usage reading)", ["tier"], registry=r)
        self.capacity = Gauge("kvdoctor_capacity_blocks", "KV block capacity per tier", ["tier"], registry=r)
        self.kv_bytes = Gauge("kvdoctor_kv_bytes", "KV bytes in use per tier (last usage reading)", ["tier"], registry=r)
        # a swap's direction is its tiers' order (device to host is out): src and dst say it all
        self.swaps = Counter("kvdoctor_swaps", "blocks moved between tiers", ["src", "dst"], registry=r)
        self.prefetched = Counter("kvdoctor_prefetched_blocks", "blocks prefetched ahead of a read", registry=r)
        self.prefetch_hits = Counter(
            "kvdoctor_prefetch_hits", "prefetched blocks read before anything else moved them (of prefetched_blocks)",
            registry=r)
        self.prefix_hits = Counter(
            "kvdoctor_prefix_hits", "blocks a sequence got by sharing another's (prefix cache, fork), of prefix_lookups",
            registry=r)
        self.prefix_lookups = Counter(
            "kvdoctor_prefix_lookups", "blocks sequences got, shared or newly allocated", registry=r)
        self.findings = Counter("kvdoctor_findings", "findings of the checks", ["check", "rule", "severity"], registry=r)
        self.events = Counter("kvdoctor_events", "events judged", registry=r)
        self.step = Gauge("kvdoctor_step", "last engine step seen", registry=r)
        self._waiting: set[int] = set()  # prefetched blocks not yet read
        # counted as events come, added to the counters at a step's end, so a scrape sees whole steps
        self._num_events = self._num_prefetch_hits = self._num_allocs = self._num_shares = 0

    def observe(self, event: Any) -> None:
        kind = type(event)
        self._num_events += 1
        if kind is Usage:
            self.blocks.labels(event.tier).set(event.used_blocks)
            self.capacity.labels(event.tier).set(event.capacity_blocks)
            if event.bytes is not None:
                self.kv_bytes.labels(event.tier).set(event.bytes)
        elif kind is SwapOut or kind is SwapIn:
            self.swaps.labels(event.src, event.dst).inc()
            self._waiting.discard(event.block)
        elif kind is Prefetch:
            self.prefetched.inc(len(event.blocks))
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
        """The step's counts join the counters at once: cheap for every event, and a scrape sees whole steps."""
        self.step.set(step)
        self.events.inc(self._num_events)
        self.prefetch_hits.inc(self._num_prefetch_hits)
        self.prefix_hits.inc(self._num_shares)
        self.prefix_lookups.inc(self._num_allocs + self._num_shares)
        self._num_events = self._num_prefetch_hits = self._num_allocs = self._num_shares = 0

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
