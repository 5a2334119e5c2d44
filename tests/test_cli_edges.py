"""A newcomer's first mistakes on the command line: each is one line on standard error and the exit code
docs/cli.md documents, before anything slow starts (issue 33, items 6 and 8)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvdoctor import events as E
from kvdoctor.cli import main
from kvdoctor.errors import EXIT_USAGE


@pytest.mark.parametrize("argv", [
    ["check", "--demo", "--model", "/nonexistent"],
    ["watch", "--demo", "--model", "/nonexistent"],
])
def test_a_model_that_is_not_there_is_a_usage_error_before_the_demo_starts(argv, capsys):
    # WHEN the demo is asked for a checkpoint directory that does not exist
    with pytest.raises(SystemExit) as done:
        main(argv)
    # THEN one line naming it, and exit 2 (not the demo's 15-line traceback and exit 3)
    err = capsys.readouterr().err
    assert done.value.code == EXIT_USAGE
    assert "/nonexistent is not a Hugging Face checkpoint directory" in err and len(err.splitlines()) == 1


def test_info_on_a_trace_still_being_written_says_so_not_that_its_writer_was_killed(tmp_path, capsys):
    # GIVEN a trace this process is writing, its last line not finished yet
    path = tmp_path / "live.kvtrace"
    header = E.Header(block_size=16, num_layers=2, tiers=[E.TierSpec(name="device", capacity_blocks=8)],
                      pid=os.getpid())
    with open(path, "wb") as f:
        f.write(E.encode(header) + b"\n" + E.encode(E.Alloc(t=1, step=0, block=1, tier="device", seq=1)) + b"\n")
        f.write(b'{"kind":"write","t":2,')
        f.flush()
        # WHEN summarized while the writer holds it open
        assert main(["info", str(path)]) == 0
        live = capsys.readouterr().out
    # THEN it is "still being written", and once the writer is gone with the line unfinished, "truncated"
    assert f"still being written (pid {os.getpid()})" in live and "killed" not in live
    assert main(["info", str(path)]) == 0
    assert "truncated (the writer was killed mid-line" in capsys.readouterr().out


WRITER = """
import os, sys, time
import msgspec
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.synthetic import SyntheticWorkload
work = SyntheticWorkload(num_steps=10)
with TraceWriter(sys.argv[1], msgspec.structs.replace(work.header(), pid=os.getpid())) as w:
    w.write_many(list(work.events())[:50])
    print("started", flush=True)
    time.sleep(1.0)
"""


def test_check_on_a_trace_still_being_written_says_it_waits_for_the_writer(tmp_path, capsys):
    # GIVEN a process that has written part of a trace and is still at work
    path = tmp_path / "live.kvtrace"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "started\n"
    # WHEN checked THEN it says, first, that it follows the trace until the writer is done, then reports
    code = main(["check", "--trace", str(path)])
    writer.wait(10)
    err = capsys.readouterr().err
    assert code == 0
    assert err.startswith(f"kvdoctor check: {path} is still being written (pid {writer.pid}); checking it as it grows")


@pytest.mark.parametrize("argv, words", [
    (["check", "--demo", "--fault", "stale-staging"], "--fault stale-staging cannot fire in the demo"),
    (["watch", "--demo", "--fault", "stale-staging"], "--fault stale-staging cannot fire in the demo"),
    (["watch", "--demo", "--fault", "wrong-scale", "--codec", "fp16"], "--fault wrong-scale cannot fire with --codec fp16"),
])
def test_a_fault_the_demo_cannot_show_is_refused_with_its_reason(argv, words, capsys):
    # WHEN the demo is asked for a fault its configuration never reaches THEN one line and exit 2, before it starts
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert words in err and len(err.splitlines()) == 1


def test_the_demo_is_set_up_for_each_fault_it_can_show():
    from kvdoctor.demo import fault_options
    from kvdoctor.engine.faults import FAULTS

    # GIVEN every fault but the one the demo cannot reach THEN each gets the options it needs (or none)
    shown = {name: fault_options(name) for name in FAULTS if name != "stale-staging"}
    assert shown["wrong-scale"] == ["--codec", "nf4"] and fault_options("wrong-scale", "device=int8,host=nf4") == []
    assert shown["prefix-unsalted"] == ["--prefix-cache"] and shown["spec-rollback-uncut"] == ["--speculative"]
    assert shown["leak-swapped"] == []


def _help(command: str) -> str:
    from kvdoctor.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command].format_help()


def test_run_help_is_grouped_and_explains_every_option_in_plain_words():
    from kvdoctor.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    run = action.choices["run"]
    # THEN its options come in groups a newcomer can scan, each with its own explanation
    titles = [g.title for g in run._action_groups if g._group_actions]
    assert titles[1:] == ["what to generate", "the KV cache", "long context and sparse attention",
                          "reuse and speculation", "recording and checking"]
    assert all(a.help and len(a.help) > 10 for a in run._actions)
    text = _help("run")
    for jargon in ("as Quest does", "Python's own documentation", "calibrat"):
        assert jargon not in text


def test_run_watch_and_check_list_the_same_faults_with_what_each_breaks():
    from kvdoctor.engine.faults import FAULTS
    from kvdoctor.faults import fault_list

    listed = fault_list()
    assert all(name in listed for name in FAULTS)
    # THEN every command that takes --fault shows that one list, word for word
    for command in ("run", "watch", "check"):
        text = _help(command)
        assert " ".join(listed.split()) in " ".join(text.split()), command


def test_check_help_names_its_sources_once():
    text = _help("check")
    assert "source (exactly one)" in text and "sources:" not in text
