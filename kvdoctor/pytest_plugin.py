"""pytest plugin: kvdoctor's checks over the KV-cache events of a test, failing it on findings.

    @pytest.mark.kvdoctor(fail_on="warning")
    def test_serving_leaves_no_leaks():
        cache = PagedKVCache(config)        # every engine built during the test is checked
        ...

    def test_with_the_fixture(kvdoctor):
        runner = make_runner()              # built before the test? attach it explicitly:
        kvdoctor.attach(runner)             # a Bus, or anything with a ``.bus``
        ...
        assert not kvdoctor.check()         # or look at the findings yourself

A marked test (or one using the ``kvdoctor`` fixture, or any test under ``pytest --kvdoctor``)
has every engine ``Bus`` created while it runs subscribed to a checking session. When the
test body returns, the sessions end (the engine's buffered events are flushed into them)
and, if any finding is at or above ``fail_on``, the test fails with a "kvdoctor" report
section listing the findings with their evidence — the way pytest-memray reports a memory
limit. Settings come from ``[tool.kvdoctor]`` in the project's pyproject.toml, the marker's
``config=`` file, and the marker's ``fail_on=`` / ``disable=`` in that order.

Limits, as pytest-memray's ``limit_memory`` and ``limit_leaks``:

    @pytest.mark.limit_kv_blocks(64)                 # at most 64 blocks allocated at once (tier="device": there)
    @pytest.mark.limit_kv_leaks(max=0, warmups=2)    # no leaked block, but the first 2 sequences' (a warm-up)
    @pytest.mark.kv_findings(fail_on="warning")      # the same as @pytest.mark.kvdoctor(fail_on="warning")

A failed test says why on one line in pytest's short summary, and prints its report once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from .config import Config, load_config
from .events import Alloc, Evict, Free, SeqStart, SwapIn, SwapOut
from .findings import Finding, severity_rank

__all__ = ["KvdoctorWatch", "BlockUse", "Limits"]

_WATCH = pytest.StashKey["KvdoctorWatch"]()
_MARK = "kvdoctor"
_MARKS = (_MARK, "kv_findings", "limit_kv_blocks", "limit_kv_leaks")  # any of them checks the test


@dataclass
class Limits:
    """What a test's markers allow beyond ``fail_on``: blocks allocated at once, and leaked blocks."""

    max_blocks: int | None = None
    blocks_tier: str | None = None  # None: every tier together
    max_leaks: int | None = None
    warmups: int = 0  # the first sequences, whose held blocks are a warm-up (a pool, a prefix cache), not leaks


class BlockUse:
    """Blocks allocated at once (now and at the peak), per tier and in all, and who allocated each: a bus sink."""

    def __init__(self, tier: str | None = None, warmups: int = 0) -> None:
        self.tier = tier
        self.warmups = warmups
        self.where: dict[int, str] = {}  # allocated block -> its tier
        self.allocated_by: dict[int, Any] = {}
        self.first_seqs: list[Any] = []  # the first ``warmups`` sequences started
        self.now = self.peak = 0
        self.peak_step = 0

    def feed(self, events: list[Any]) -> None:
        for e in events:
            kind = type(e)
            if kind is Alloc:
                self.where[e.block] = e.tier
                self.allocated_by[e.block] = e.seq
                if self.tier is None or e.tier == self.tier:
                    self._count(+1, e.step)
            elif kind is Free or kind is Evict:
                tier = self.where.pop(e.block, None)
                if tier is not None and (self.tier is None or tier == self.tier):
                    self._count(-1, e.step)
            elif kind is SwapOut or kind is SwapIn:
                tier = self.where.get(e.block)
                if tier is not None and self.tier is not None and (tier == self.tier) != (e.dst == self.tier):
                    self._count(+1 if e.dst == self.tier else -1, e.step)
                if tier is not None:
                    self.where[e.block] = e.dst
            elif kind is SeqStart and len(self.first_seqs) < self.warmups:
                self.first_seqs.append(e.seq)

    def _count(self, delta: int, step: int) -> None:
        self.now += delta
        if self.now > self.peak:
            self.peak, self.peak_step = self.now, step

    def warm_up(self, block: int | None) -> bool:
        """True when ``block`` was allocated by one of the warm-up sequences."""
        return block is not None and self.allocated_by.get(block, object()) in self.first_seqs


class KvdoctorWatch:
    """The checks of one test: one session per engine bus, all judged together at the end."""

    def __init__(self, config: Config, limits: Limits | None = None) -> None:
        self.config = config
        self.limits = limits or Limits()
        self.usage = BlockUse(self.limits.blocks_tier, self.limits.warmups)
        self._sessions: list[Any] = []
        self._ended = False
        self._restore: Any = None

    def attach(self, target: Any) -> Any:
        """Check the events of ``target``: an engine ``Bus`` or anything with a ``.bus``."""
        from .session import Session

        bus = getattr(target, "bus", target)
        if not hasattr(bus, "subscribe"):
            raise TypeError(f"kvdoctor.attach needs an engine Bus or an object with .bus, got {type(target).__name__}")
        if any(s._bus is bus for s in self._sessions):
            return next(s for s in self._sessions if s._bus is bus)
        bus.subscribe(self.usage.feed)
        session = Session.on_bus(bus, self.config)
        self._sessions.append(session)
        return session

    def check(self) -> list[Finding]:
        """End the sessions now (idempotent) and return every finding."""
        if not self._ended:
            self._ended = True
            self.stop_capturing()
            for session in self._sessions:
                bus = session._bus
                session.close()  # flushes the bus into every sink, the block count's too
                if bus is not None:
                    bus.unsubscribe(self.usage.feed)
        return self.findings

    @property
    def findings(self) -> list[Finding]:
        return [f for s in self._sessions for f in s.findings]

    def leaks(self) -> list[Finding]:
        """Leak findings that count against ``limit_kv_leaks``: not about a warm-up sequence's block."""
        return [f for f in self.findings if f.check == "leak" and not self.usage.warm_up(f.block)]

    def failing(self) -> list[Finding]:
        """Findings at or above ``fail_on``; under ``limit_kv_leaks`` leaks are judged by the limit instead."""
        bar = severity_rank(self.config.fail_on)
        judged_apart = self.limits.max_leaks is not None
        return [f for f in self.findings
                if severity_rank(f.severity) >= bar and not (judged_apart and f.check == "leak")]

    def failures(self) -> list[str]:
        """Why the test fails, one line each: findings first, then the limits it went over."""
        out = []
        failing = self.failing()
        if failing:
            first = failing[0]
            more = f" (+{len(failing) - 1} more)" if len(failing) > 1 else ""
            out.append(f"{first.check}/{first.rule}: {first.message}{more}")
        limits = self.limits
        if limits.max_blocks is not None and self.usage.peak > limits.max_blocks:
            where = f" on {limits.blocks_tier}" if limits.blocks_tier else ""
            out.append(f"{self.usage.peak} KV blocks allocated at once{where} (at step {self.usage.peak_step}), "
                       f"limit_kv_blocks is {limits.max_blocks}")
        if limits.max_leaks is not None:
            leaks = self.leaks()
            if len(leaks) > limits.max_leaks:
                warm = f" after {limits.warmups} warm-up sequence(s)" if limits.warmups else ""
                out.append(f"{len(leaks)} leaked KV block finding(s){warm}, limit_kv_leaks allows {limits.max_leaks}: "
                           f"{leaks[0].check}/{leaks[0].rule}: {leaks[0].message}")
        return out

    def report_text(self) -> str:
        from .report import Report, render

        report = Report(self.findings, fail_on=self.config.fail_on, source="engine events of this test",
                        num_events=sum(s.num_events for s in self._sessions),
                        suppressed=sum(s.suite.suppressed for s in self._sessions))
        return render(report, "text")

    # ---- every Bus built during the test ----------------------------------------------

    def start_capturing(self) -> None:
        from .engine import Bus

        original = Bus.__init__
        watch = self

        def init(bus: Any, *args: Any, **kwargs: Any) -> None:
            original(bus, *args, **kwargs)
            watch.attach(bus)

        Bus.__init__ = init  # type: ignore[method-assign]
        self._restore = lambda: setattr(Bus, "__init__", original)

    def stop_capturing(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvdoctor")
    group.addoption("--kvdoctor", action="store_true", default=False,
                    help="run kvdoctor's checks over the engine events of every test")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "kvdoctor(fail_on='error', disable=(), config=None): check the KV-cache events of every engine "
        "built during the test and fail it on findings at or above fail_on",
        "kv_findings(fail_on='error', disable=(), config=None): the same as kvdoctor(...)",
        "limit_kv_blocks(n, tier=None): fail the test when more than n KV blocks are allocated at once "
        "(on one tier, or on all together)",
        "limit_kv_leaks(max=0, warmups=0): fail the test on more than max leaked KV blocks, not counting "
        "blocks of its first warmups sequences (a pool or prefix cache warming up)",
    ):
        config.addinivalue_line("markers", line)


def _int_arg(name: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        pytest.fail(f"@pytest.mark.{name}: expected an integer >= {low}, got {value!r}", pytrace=False)
    return value


def _limits(item: pytest.Item) -> Limits:
    limits = Limits()
    blocks = item.get_closest_marker("limit_kv_blocks")
    if blocks is not None:
        args = dict(zip(("n", "tier"), blocks.args)) | blocks.kwargs
        if set(args) - {"n", "tier"} or "n" not in args:
            pytest.fail("@pytest.mark.limit_kv_blocks takes n and tier=, as limit_kv_blocks(64, tier='device')",
                        pytrace=False)
        limits.max_blocks = _int_arg("limit_kv_blocks", args["n"])
        limits.blocks_tier = args.get("tier")
    leaks = item.get_closest_marker("limit_kv_leaks")
    if leaks is not None:
        args = dict(zip(("max", "warmups"), leaks.args)) | leaks.kwargs
        if set(args) - {"max", "warmups"}:
            pytest.fail("@pytest.mark.limit_kv_leaks takes max= and warmups=, as limit_kv_leaks(max=0, warmups=2)",
                        pytrace=False)
        limits.max_leaks = _int_arg("limit_kv_leaks", args.get("max", 0))
        limits.warmups = _int_arg("limit_kv_leaks", args.get("warmups", 0))
    return limits


def _make_watch(item: pytest.Item) -> KvdoctorWatch:
    mark = item.get_closest_marker(_MARK) or item.get_closest_marker("kv_findings")
    name = f"@pytest.mark.{mark.name}" if mark is not None else "@pytest.mark.kvdoctor"
    kwargs = dict(mark.kwargs) if mark is not None else {}
    unknown = set(kwargs) - {"fail_on", "disable", "config"}
    if unknown:
        pytest.fail(f"{name}: unknown argument(s) {', '.join(sorted(unknown))}", pytrace=False)
    from .errors import UsageError

    try:
        config = load_config(kwargs.get("config"), start=str(item.config.rootpath))
        disable = kwargs.get("disable") or ()
        config = config.with_overrides(fail_on=kwargs.get("fail_on"), source=name,
                                       disable=[disable] if isinstance(disable, str) else list(disable))
    except UsageError as exc:
        pytest.fail(str(exc), pytrace=False)
    return KvdoctorWatch(config, _limits(item))


def _watch_for(item: pytest.Item) -> KvdoctorWatch:
    watch = item.stash.get(_WATCH, None)
    if watch is None:
        watch = item.stash[_WATCH] = _make_watch(item)
    return watch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if any(item.get_closest_marker(m) is not None for m in _MARKS) or item.config.getoption("kvdoctor"):
        _watch_for(item).start_capturing()  # before fixtures, so engines they build are seen
    yield


@pytest.fixture
def kvdoctor(request: pytest.FixtureRequest) -> KvdoctorWatch:
    """The test's checks: ``attach(bus_or_engine)``, ``check()``, ``findings``."""
    watch = _watch_for(request.node)
    if watch._restore is None and not watch._ended:
        watch.start_capturing()
    return watch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield
    watch = item.stash.get(_WATCH, None)
    if watch is not None:
        watch.check()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    watch = item.stash.get(_WATCH, None)
    if watch is None:
        return
    if call.when == "teardown":
        watch.stop_capturing()  # a test that failed in setup never reached pytest_runtest_call
        return
    if call.when != "call":
        return
    report = outcome.get_result()
    failures = watch.failures()
    if not watch.findings and not failures:
        return
    text = watch.report_text()
    if failures and report.passed:
        report.outcome = "failed"
        report.longrepr = _Failure(failures, text)  # the report once, in the failure
    else:
        report.sections.append(("kvdoctor", text))


@dataclass
class _Failure:
    """A failed test's ``longrepr``: pytest prints it, puts ``reprcrash.message`` on the short summary line
    (``FAILED test_x.py::test_leak - kvdoctor: leak/...``) and in JUnit's failure message."""

    lines: list[str]
    text: str
    reprcrash: Any = field(init=False)

    def __post_init__(self) -> None:
        message = "kvdoctor: " + "; ".join(self.lines)
        self.reprcrash = _Crash(message)

    def toterminal(self, out: Any) -> None:
        for line in str(self).splitlines():
            out.line(line)

    def __str__(self) -> str:
        return "\n".join(f"kvdoctor: {line}" for line in self.lines) + "\n\n" + self.text


@dataclass
class _Crash:
    message: str
