"""The pytest plugin: a marked test fails on findings in its engine's events, with a report
section naming the rule, sequence and block; clean tests pass; the fixture attaches buses."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# The in-process runs below must not share pytest-textual-snapshot's session temp dir with ours.
_ISOLATE = ("-p", "no:textual-snapshot", "-p", "no:cacheprovider")


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(*_ISOLATE, *args)

LEAKY = '''
import pytest
from kvdoctor.engine.bus import Bus
from kvdoctor.events import Alloc, SeqEnd, SeqStart, SwapOut, Write

def leak(bus, swap=True):
    bus.emit(SeqStart, seq="req-7", prompt_len=4)
    bus.emit(Alloc, block=41, tier="device", seq="req-7")
    bus.emit(Write, block=41, seq="req-7", pos=0, n=4, version=4)
    if swap:
        bus.emit(SwapOut, block=41, src="device", dst="host", version=4)
    bus.emit(SeqEnd, seq="req-7")
    bus.end_step()
'''


def test_marked_test_with_a_leak_fails_with_a_report_section(pytester: pytest.Pytester):
    pytester.makepyfile(LEAKY + '''
@pytest.mark.kvdoctor
def test_serving():
    leak(Bus())
''')
    result = run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*kvdoctor: 1 finding(s) at or above 'error'*",
        "*leak/unreachable-swapped*seq 'req-7'*block 41*",
        "*KVDOCTOR SUMMARY: 1 errors, 0 warnings, 0 info*",
    ])


def test_clean_marked_test_passes(pytester: pytest.Pytester):
    pytester.makepyfile(LEAKY + '''
from kvdoctor.events import Free

@pytest.mark.kvdoctor
def test_serving():
    bus = Bus()
    bus.emit(SeqStart, seq=1, prompt_len=1)
    bus.emit(Alloc, block=1, tier="device", seq=1)
    bus.emit(SeqEnd, seq=1)
    bus.emit(Free, block=1)
    bus.end_step()
''')
    run(pytester).assert_outcomes(passed=1)


def test_fail_on_and_disable_in_the_marker(pytester: pytest.Pytester):
    pytester.makepyfile(LEAKY + '''
@pytest.mark.kvdoctor(disable=["leak/unreachable-swapped"])
def test_disabled():
    leak(Bus())

@pytest.mark.kvdoctor(fail_on="error", disable="leak")
def test_disabled_check():
    leak(Bus())
''')
    run(pytester).assert_outcomes(passed=2)


def test_unmarked_tests_are_not_checked_unless_asked(pytester: pytest.Pytester):
    pytester.makepyfile(LEAKY + '''
def test_plain():
    leak(Bus())
''')
    run(pytester).assert_outcomes(passed=1)
    run(pytester, "--kvdoctor").assert_outcomes(failed=1)


def test_fixture_attaches_a_bus_built_before_the_test(pytester: pytest.Pytester):
    pytester.makepyfile(LEAKY + '''
BUS = Bus()

def test_with_fixture(kvdoctor):
    kvdoctor.attach(BUS)
    leak(BUS, swap=False)
    found = kvdoctor.check()
    assert [f.rule for f in found] == ["unreachable"]
    assert found[0].block == 41
''')
    result = run(pytester)
    result.assert_outcomes(failed=1)  # the assertions pass; the finding itself fails the test
    result.stdout.fnmatch_lines(["*leak/unreachable *block 41*"])


def test_bad_marker_arguments_are_a_usage_error(pytester: pytest.Pytester):
    pytester.makepyfile('''
import pytest

@pytest.mark.kvdoctor(fail_on="sometimes")
def test_x():
    pass
''')
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.kvdoctor: fail_on must be one of error, warning, info, got 'sometimes'*"])
