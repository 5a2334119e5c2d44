"""Fuzzing the trace readers: mutated copies of a real-shaped trace, JSON Lines and msgpack, through
`kvdoctor check --format json` and `kvdoctor info`.

Every input keeps the rule in tests/fuzzing.py (exit 0-3, one stderr line at most, no traceback, no
hang), read from a file, through a FIFO (a non-seekable stream, as ``--trace -`` is) and while a process
is still writing it. Where the mutation is known to corrupt the file, it is never reported clean: a malformed
line before the last is exit 3 (the format says so), and a cut inside a line or frame is exit 3 or
a report that says the trace was cut short.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import FUZZ, LIVE_PID, Tally, fifo_fed, run_kvdoctor, written_live
from kvdoctor import binary_trace
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.synthetic import SyntheticWorkload

# JSON values a field may be set to: wrong types, huge and negative numbers (2**70 once broke check).
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**70])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


class Corpus(dict):
    """The traces mutated (a short repr: hypothesis prints the arguments of a failing example)."""

    def __repr__(self) -> str:
        return f"Corpus({self['dir']})"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A clean synthetic serving trace (swaps, aborts, attention, memory), as JSON Lines and as msgpack."""
    out = tmp_path_factory.mktemp("fuzz")
    work = SyntheticWorkload(num_steps=40)
    events = list(work.events())
    paths = {}
    for name in ("run.kvtrace", "run.kvtrace.msgpack"):
        with TraceWriter(out / name, work.header()) as writer:
            writer.write_many(events)
        paths[name] = out / name
    data = paths["run.kvtrace"].read_bytes()
    header, rest = data.split(b"\n", 1)
    live = json.dumps(dict(json.loads(header), pid=LIVE_PID), separators=(",", ":")).encode() + b"\n" + rest
    return Corpus(dir=out, json=data, msgpack=paths["run.kvtrace.msgpack"].read_bytes(), live=live)


@st.composite
def mutated_lines(draw, data: bytes) -> tuple[bytes, str | None]:
    """``data`` (JSON Lines) changed once; the second item names a corruption the report must show."""
    lines = data.split(b"\n")[:-1]
    i = draw(st.integers(0, len(lines) - 1))
    kind = draw(st.sampled_from(["flip", "cut", "drop", "dup", "swap", "garbage", "field", "header", "bytes"]))
    claim = None
    if kind == "flip":
        pos = draw(st.integers(0, len(data) - 1))
        return data[:pos] + bytes([data[pos] ^ draw(st.integers(1, 255))]) + data[pos + 1:], None
    if kind == "cut":
        pos = draw(st.integers(1, len(data) - 1))
        partial = data[:pos].rsplit(b"\n", 1)[-1]
        if partial and not _is_json(partial):
            claim = "cut"
        return data[:pos], claim
    if kind == "drop":
        del lines[i]
    elif kind == "dup":
        lines.insert(i, lines[i])
    elif kind == "swap":
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "garbage":
        junk = draw(st.binary(min_size=1, max_size=40) | st.text(min_size=1, max_size=40).map(str.encode))
        junk = junk.replace(b"\n", b" ").replace(b"\r", b" ")
        at = draw(st.integers(1, len(lines) - 1))  # never the last line: that one may be a cut
        lines.insert(at, junk)
        claim = None if _is_json(junk) or not junk.strip() else "garbage"
    elif kind in ("field", "header"):
        at = 0 if kind == "header" else i
        obj = json.loads(lines[at])
        key = draw(st.sampled_from(sorted(obj)) | st.text(max_size=8))
        obj[key] = draw(JSON_VALUES)
        lines[at] = json.dumps(obj).encode()
    else:  # bytes: a random file
        return draw(st.binary(max_size=300)), None
    return b"\n".join(lines) + b"\n", claim


@st.composite
def mutated_frames(draw, data: bytes) -> tuple[bytes, str | None]:
    """``data`` (msgpack frames) changed once; "cut" when it now ends inside a frame."""
    kind = draw(st.sampled_from(["flip", "cut", "insert", "bytes"]))
    pos = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        return data[:pos] + bytes([data[pos] ^ draw(st.integers(1, 255))]) + data[pos + 1:], None
    if kind == "cut":
        return data[:pos], None if pos in _frame_ends(data) else "cut"
    if kind == "insert":
        return data[:pos] + draw(st.binary(min_size=1, max_size=40)) + data[pos:], None
    return binary_trace.MAGIC + draw(st.binary(max_size=300)), None


def _frame_ends(data: bytes) -> set[int]:
    """Offsets where a whole frame ends: a cut there loses whole frames only."""
    ends, at = set(), len(binary_trace.MAGIC)
    while at + 4 <= len(data):
        at += 4 + int.from_bytes(data[at:at + 4], "little")
        ends.add(at)
    return ends


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _judge(tally: Tally, path: Path, data: bytes, claim: str | None) -> None:
    """Both commands over one mutated trace, against the rule and the claim."""
    path.write_bytes(data)
    check = run_kvdoctor(["check", "--trace", str(path), "--format", "json"])
    tally.judge(check, _missed(check, claim))
    tally.judge(run_kvdoctor(["info", str(path)]))


def _missed(check, claim: str | None) -> str | None:
    """What ``check``'s outcome fails to say about a corruption the mutation is known to have made."""
    if claim and check.code in (0, 1) and not json.loads(check.stdout)["summary"]["truncated"]:
        return f"a corrupt trace ({claim}) reported as whole: exit {check.code}"
    if claim == "garbage" and check.code != 3:
        return f"a malformed line inside the trace gave exit {check.code}, not 3"
    return None


JSON_TALLY, MSGPACK_TALLY = Tally("json trace reader"), Tally("msgpack trace reader")
FIFO_TALLY, LIVE_TALLY = Tally("trace read through a FIFO"), Tally("trace still being written")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for tally in (JSON_TALLY, MSGPACK_TALLY, FIFO_TALLY, LIVE_TALLY):
        tally.write()


@FUZZ
@given(data=st.data())
def test_mutated_json_traces_keep_the_rule(traces, data):
    mutated, claim = data.draw(mutated_lines(traces["json"]))
    _judge(JSON_TALLY, traces["dir"] / "mutated.kvtrace", mutated, claim)


@FUZZ
@given(data=st.data())
def test_mutated_msgpack_traces_keep_the_rule(traces, data):
    mutated, claim = data.draw(mutated_frames(traces["msgpack"]))
    _judge(MSGPACK_TALLY, traces["dir"] / "mutated.kvtrace.msgpack", mutated, claim)


@FUZZ
@given(data=st.data())
def test_mutated_traces_through_a_fifo_keep_the_rule(traces, data):
    # GIVEN a mutated trace, either encoding, that a writer feeds through a FIFO in pieces of any size
    binary = data.draw(st.booleans())
    mutated, claim = data.draw(mutated_frames(traces["msgpack"]) if binary else mutated_lines(traces["json"]))
    command = data.draw(st.sampled_from(["check", "info"]))  # a stream is read once: one command per FIFO
    with fifo_fed(traces["dir"] / "fuzz.fifo", mutated, data.draw(st.integers(512, 1 << 17))) as fifo:
        argv = ["check", "--trace", str(fifo), "--format", "json"] if command == "check" else ["info", str(fifo)]
        outcome = run_kvdoctor(argv)
    # THEN the rule holds, and check says what a file's check says about the corruption
    FIFO_TALLY.judge(outcome, _missed(outcome, claim) if command == "check" else None)


@FUZZ
@given(data=st.data())
def test_mutated_traces_still_being_written_keep_the_rule(traces, data):
    # GIVEN a mutated trace that another process is writing in pieces, naming itself in the header
    mutated, claim = data.draw(mutated_lines(traces["live"]))
    path = traces["dir"] / "live.kvtrace"
    with written_live(path, mutated) as writer:
        while path.stat().st_size == 0 and writer.poll() is None:
            time.sleep(0.005)  # its first piece is written: the header, as a followed trace has it
        outcome = run_kvdoctor(["check", "--trace", str(path), "--format", "json"])
    # THEN the rule holds (the note that the trace is followed aside), and the corruption is not missed
    notes = [line for line in outcome.stderr.splitlines() if "is still being written" in line]
    outcome.stderr = "".join(f"{line}\n" for line in outcome.stderr.splitlines() if line not in notes)
    LIVE_TALLY.judge(outcome, _missed(outcome, claim))


@pytest.mark.parametrize("pid", [2**70, -1, 0, 2**22], ids=["2**70", "-1", "0", "2**22"])
def test_a_header_pid_no_process_can_have_is_read_as_a_finished_trace(traces, pid):
    # GIVEN a whole trace whose header names an impossible writer pid (2**70 once gave OverflowError)
    lines = traces["json"].split(b"\n")
    lines[0] = json.dumps(dict(json.loads(lines[0]), pid=pid)).encode()
    path = traces["dir"] / "pid.kvtrace"
    path.write_bytes(b"\n".join(lines))
    # WHEN it is checked THEN it is read as finished: clean, exit 0, one summary line
    outcome = run_kvdoctor(["check", "--trace", str(path), "--format", "json"])
    assert outcome.broken_rule() is None and outcome.code == 0
    assert json.loads(outcome.stdout)["findings"] == []
