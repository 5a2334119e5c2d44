"""`kvdoctor info`: reads what the writer writes and what a person writes from the docs; bad input is one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor import events as E
from kvdoctor.cli import main
from kvdoctor.trace import TraceWriter

DOC = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"


def _kvdoctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True)


def test_info_reads_the_hand_written_trace_from_the_docs(tmp_path, capsys):
    # GIVEN the example trace exactly as docs/trace-format.md prints it
    example = re.search(r"```\n(\{\"kind\":\"header\".*?)```", DOC.read_text(), re.S).group(1)
    path = tmp_path / "by-hand.kvtrace"
    path.write_text(example)
    # WHEN summarized THEN every line is understood
    assert main(["info", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_events"] == 8 and info["num_sequences"] == 1
    assert info["kinds"]["swap_in"] == 1 and info["steps"] == [0, 2]
    assert not info["truncated"] and not info["closed"]


def test_info_reads_a_written_trace(tmp_path, capsys):
    path = tmp_path / "w.kvtrace"
    header = E.Header(block_size=16, num_layers=30, model="m", tiers=[
        E.TierSpec(name="device", capacity_blocks=4, codec="mixed"), E.TierSpec(name="host", capacity_blocks=8)])
    with TraceWriter(path, header) as w:
        w.write_many([E.SeqStart(seq="a", prompt_len=4), E.SeqStart(t=5, seq="b", prompt_len=4),
                      E.StepEnd(t=2_000_000_000)])
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sequences  2" in out and "closed by the writer" in out and "duration   2.000 s" in out
    assert "device 4 blocks (mixed), host 8 blocks" in out


@pytest.mark.parametrize("content, code, message", [
    (None, 3, "no such trace file"),
    (b"", 3, "is empty"),
    (b"PK\x03\x04 zip", 3, "not a kvdoctor trace"),
    (b'{"kind":"header","format":"kvdoctor-trace","version":"9.1","block_size":1,"num_layers":1,"tiers":[]}\n', 3,
     "version 9.1"),
    (b'{"kind":"header","format":"kvdoctor-trace","version":"1.0","block_size":1,"num_layers":1,"tiers":[]}\n'
     b'{"kind":"free","block":1}\n{"kind":"free","block":[}\n{"kind":"free","block":2}\n', 3, ":3: malformed event"),
])
def test_bad_input_is_one_clear_line_and_exit_code(tmp_path, content, code, message):
    path = tmp_path / "bad.kvtrace"
    if content is not None:
        path.write_bytes(content)
    proc = _kvdoctor("info", str(path))
    assert proc.returncode == code
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_usage_error_exits_2():
    proc = _kvdoctor("info")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
