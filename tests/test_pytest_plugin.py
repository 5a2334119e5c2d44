"""The pytest plugin: a marked test fails on findings in its engine's events, with a report
section naming the rule, sequence and block; clean tests pass; the fixture attaches buses."""

from __future__ import annotations

import xml.etree.ElementTree as ET

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


def test_marked_test_with_a_leak_fails_with_one_report_and_a_reason_in_the_short_summary(pytester: pytest.Pytester):
    pytester.makepyfile(test_t=LEAKY + '''
@pytest.mark.kvdoctor
def test_serving():
    leak(Bus())
''')
    result = run(pytester, "-rf", "-vv")  # -vv: the reason in full, not cut to 80 columns
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*leak/unreachable-swapped*seq 'req-7'*block 41*",
        "*KVDOCTOR SUMMARY: 1 errors, 0 warnings, 0 info*",
        "*short test summary info*",
        "FAILED test_t.py::test_serving - kvdoctor: leak/unreachable-swapped: block 41 sits on host*",
    ])
    # THEN the report is printed once
    assert result.stdout.str().count("KVDOCTOR SUMMARY") == 1


def test_the_reason_is_the_junit_failure_message(pytester: pytest.Pytester):
    pytester.makepyfile(test_t=LEAKY + '''
@pytest.mark.kvdoctor
def test_serving():
    leak(Bus())
''')
    run(pytester, "--junitxml=out.xml").assert_outcomes(failed=1)
    failure = ET.parse(pytester.path / "out.xml").find(".//failure")
    assert failure.get("message").startswith("kvdoctor: leak/unreachable-swapped: block 41 sits on host")
    assert "KVDOCTOR SUMMARY: 1 errors" in failure.text


GROWING = '''
import pytest
from kvdoctor.engine.bus import Bus
from kvdoctor.events import Alloc, Free, SeqEnd, SeqStart, SwapOut, Write

def serve(bus, requests, blocks_each, kept=()):
    """Each request takes ``blocks_each`` blocks; the requests in ``kept`` leave their swapped-out block behind."""
    block = 0
    for r in range(requests):
        bus.emit(SeqStart, seq=r, prompt_len=4)
        mine = list(range(block, block + blocks_each))
        block += blocks_each
        for b in mine:
            bus.emit(Alloc, block=b, tier="device", seq=r)
            bus.emit(Write, block=b, seq=r, pos=4 * (b - mine[0]), n=4, version=4 * (b - mine[0] + 1))
        bus.emit(SwapOut, block=mine[-1], src="device", dst="host", version=4 * blocks_each)
        bus.emit(SeqEnd, seq=r)
        for b in mine[:-1] if r in kept else mine:
            bus.emit(Free, block=b)
        bus.end_step()
'''


def test_limit_kv_blocks_fails_a_test_that_holds_more_blocks_at_once(pytester: pytest.Pytester):
    pytester.makepyfile(test_t=GROWING + '''
@pytest.mark.limit_kv_blocks(4)
def test_small():
    serve(Bus(), requests=3, blocks_each=4)

@pytest.mark.limit_kv_blocks(4)
def test_big():
    serve(Bus(), requests=2, blocks_each=5)

@pytest.mark.limit_kv_blocks(3, tier="host")
def test_host_only():
    serve(Bus(), requests=2, blocks_each=5)
''')
    result = run(pytester, "-rf", "-vv")  # -vv: the reason in full, not cut to 80 columns
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_t.py::test_big - kvdoctor: 5 KV blocks allocated at once (at step 0), "
                                 "limit_kv_blocks is 4*"])


def test_limit_kv_leaks_counts_leaks_after_the_warm_up(pytester: pytest.Pytester):
    pytester.makepyfile(test_t=GROWING + '''
@pytest.mark.limit_kv_leaks(max=0, warmups=2)
def test_warm_up_keeps_blocks():
    serve(Bus(), requests=4, blocks_each=2, kept={0, 1})   # a pool warming up: not leaks

@pytest.mark.limit_kv_leaks(max=1)
def test_one_leak_allowed():
    serve(Bus(), requests=4, blocks_each=2, kept={3})

@pytest.mark.limit_kv_leaks(max=0, warmups=2)
def test_leak_after_the_warm_up():
    serve(Bus(), requests=4, blocks_each=2, kept={0, 3})
''')
    result = run(pytester, "-rf", "-vv")  # -vv: the reason in full, not cut to 80 columns
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "FAILED test_t.py::test_leak_after_the_warm_up - kvdoctor: 1 leaked KV block finding(s) after 2 warm-up "
        "sequence(s), limit_kv_leaks allows 0: leak/unreachable-swapped: block 7 sits on host*",
    ])


def test_kv_findings_is_the_kvdoctor_marker_by_another_name(pytester: pytest.Pytester):
    pytester.makepyfile(test_t=LEAKY + '''
@pytest.mark.kv_findings(fail_on="error")
def test_leaks():
    leak(Bus())

@pytest.mark.kv_findings(disable="leak")
def test_leak_not_checked():
    leak(Bus())
''')
    run(pytester).assert_outcomes(passed=1, failed=1)


@pytest.mark.parametrize("mark, message", [
    ("limit_kv_blocks()", "limit_kv_blocks takes n and tier="),
    ("limit_kv_blocks(-1)", "limit_kv_blocks: expected an integer >= 0, got -1"),
    ("limit_kv_leaks(max='none')", "limit_kv_leaks: expected an integer >= 0, got 'none'"),
    ("limit_kv_leaks(maximum=0)", "limit_kv_leaks takes max= and warmups="),
])
def test_bad_limits_are_a_usage_error(pytester: pytest.Pytester, mark, message):
    pytester.makepyfile(test_t=f'''
import pytest

@pytest.mark.{mark}
def test_x():
    pass
''')
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.{message}*"])


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


def test_limits_apply_to_a_test_that_calls_generate_on_the_engine(pytester: pytest.Pytester):
    pytest.importorskip("torch")
    pytester.makepyfile(test_t='''
import pytest
import torch
from kvdoctor.engine import EngineCache
from kvdoctor.engine.model.model import tiny_llama

def generate(cache_blocks=32):
    model = tiny_llama().model
    with EngineCache(model, block_size=4, device_blocks=cache_blocks) as cache:
        model.generate(torch.tensor([[5, 6, 7, 8, 9, 10]]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                       cache=cache)

@pytest.mark.limit_kv_blocks(2)
def test_too_many_blocks():
    generate()

@pytest.mark.limit_kv_blocks(3)
@pytest.mark.limit_kv_leaks(max=0)
def test_fits():
    generate()
''')
    # a subprocess: torch and numpy load once per process, and pytester's in-process runs unload them
    result = pytester.runpytest_subprocess(*_ISOLATE, "-rf", "-vv")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_t.py::test_too_many_blocks - kvdoctor: 3 KV blocks allocated at once "
                                 "(at step *), limit_kv_blocks is 2*"])
