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
"""

from __future__ import annotations

from typing import Any

import pytest

from .config import Config, load_config
from .findings import Finding, severity_rank

__all__ = ["KvdoctorWatch"]

_WATCH = pytest.StashKey["KvdoctorWatch"]()
_MARK = "kvdoctor"


class KvdoctorWatch:
    """The checks of one test: one session per engine bus, all judged together at the end."""

    def __init__(self, config: Config) -> None:
        self.config = config
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
        session = Session.on_bus(bus, self.config)
        self._sessions.append(session)
        return session

    def check(self) -> list[Finding]:
        """End the sessions now (idempotent) and return every finding."""
        if not self._ended:
            self._ended = True
            self.stop_capturing()
            for session in self._sessions:
                session.close()
        return self.findings

    @property
    def findings(self) -> list[Finding]:
        return [f for s in self._sessions for f in s.findings]

    def failing(self) -> list[Finding]:
        bar = severity_rank(self.config.fail_on)
        return [f for f in self.findings if severity_rank(f.severity) >= bar]

    def report_text(self) -> str:
        from .report import Report, render

        report = Report(self.findings, fail_on=self.config.fail_on, source="engine events of this test",
                        num_events=sum(s.num_events for s in self._sessions),
                        suppressed=sum(s.suite.suppressed for s in self._sessions))
        return render(report, "text")

    # ---- every Bus built during the test ----------------------------------------------

    def start_capturing(self) -> None:
        from .engine.bus import Bus

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
    config.addinivalue_line(
        "markers",
        "kvdoctor(fail_on='error', disable=(), config=None): check the KV-cache events of every engine "
        "built during the test and fail it on findings at or above fail_on",
    )


def _make_watch(item: pytest.Item) -> KvdoctorWatch:
    mark = item.get_closest_marker(_MARK)
    kwargs = dict(mark.kwargs) if mark is not None else {}
    unknown = set(kwargs) - {"fail_on", "disable", "config"}
    if unknown:
        pytest.fail(f"@pytest.mark.kvdoctor: unknown argument(s) {', '.join(sorted(unknown))}", pytrace=False)
    from .errors import UsageError

    try:
        config = load_config(kwargs.get("config"), start=str(item.config.rootpath))
        disable = kwargs.get("disable") or ()
        config = config.with_overrides(fail_on=kwargs.get("fail_on"), source="@pytest.mark.kvdoctor",
                                       disable=[disable] if isinstance(disable, str) else list(disable))
    except UsageError as exc:
        pytest.fail(str(exc), pytrace=False)
    return KvdoctorWatch(config)


def _watch_for(item: pytest.Item) -> KvdoctorWatch:
    watch = item.stash.get(_WATCH, None)
    if watch is None:
        watch = item.stash[_WATCH] = _make_watch(item)
    return watch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if item.get_closest_marker(_MARK) is not None or item.config.getoption("kvdoctor"):
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
    if not watch.findings:
        return
    text = watch.report_text()
    report.sections.append(("kvdoctor", text))
    failing = watch.failing()
    if failing and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"kvdoctor: {len(failing)} finding(s) at or above {watch.config.fail_on!r} "
                           f"in this test's KV-cache events\n\n{text}")
