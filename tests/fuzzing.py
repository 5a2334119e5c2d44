"""The fuzz tests' harness: run ``kvdoctor`` on one input, in this process, and judge the outcome.

The rule every input must keep (issue #17): exit code 0-3, at most one line on stderr, never a
traceback (an exception escaping ``main``), never a hang (each input under ``TIME_BOUND_S``).

Budget: ``KVDOCTOR_FUZZ_EXAMPLES`` inputs per fuzz test (default ``CI_EXAMPLES``, which keeps the
whole set under a minute on two busy cores); a release check raises it, e.g.
``KVDOCTOR_FUZZ_EXAMPLES=2000 ./kvd test -q tests/test_fuzz_traces.py tests/test_fuzz_cli.py``.
With ``KVDOCTOR_FUZZ_REPORT=FILE`` each test appends its tally (inputs tried, rule broken) as one
JSON line, the figures docs/benchmarks.md quotes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hypothesis import HealthCheck, settings

from kvdoctor import knobs, trace
from kvdoctor.cli import main

CI_EXAMPLES = 40
TIME_BOUND_S = 10.0
EXAMPLES = knobs.get(knobs.FUZZ_EXAMPLES) or CI_EXAMPLES

# derandomize: CI runs the same inputs every time (a failure reproduces); a long run explores afresh.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= CI_EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


class Hang(Exception):
    pass


@dataclass
class Outcome:
    argv: list[str]
    code: int | None
    stdout: str
    stderr: str
    crash: str | None  # the traceback of an exception that escaped main

    def broken_rule(self) -> str | None:
        """What in the rule this outcome breaks, or None."""
        if self.crash is not None:
            return f"traceback:\n{self.crash}"
        if self.code not in (0, 1, 2, 3):
            return f"exit code {self.code}"
        if len(self.stderr.splitlines()) > 1:
            return f"{len(self.stderr.splitlines())} lines on stderr:\n{self.stderr}"
        if "Traceback" in self.stderr:
            return f"a traceback on stderr:\n{self.stderr}"
        return None


def _on_alarm(signum: int, frame: object) -> None:
    raise Hang(f"no answer within {TIME_BOUND_S} s")


def run_kvdoctor(argv: list[str]) -> Outcome:
    """``kvdoctor ARGV`` in this process, its output captured, cut off after ``TIME_BOUND_S``."""
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    crash = None
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_BOUND_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # argparse: --help, a bad option
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # noqa: BLE001 - anything else escaping main is what the fuzzer hunts
        crash = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(argv, code, out.getvalue(), err.getvalue(), crash)


class Tally:
    """Inputs tried and rules broken by one fuzz test, for the long run's report."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: Counter[str] = Counter()

    def judge(self, outcome: Outcome, extra: str | None = None) -> None:
        """Count the input; fail the example when it breaks the rule (or ``extra``, a further claim, failed)."""
        self.counts["inputs"] += 1
        self.counts[f"exit {outcome.code}"] += 1
        broken = outcome.broken_rule() or extra
        if broken:
            self.counts["failures"] += 1
        assert broken is None, f"kvdoctor {' '.join(outcome.argv)}: {broken}"

    def write(self) -> None:
        path = knobs.get(knobs.FUZZ_REPORT)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"test": self.name, **self.counts}) + "\n")


@contextlib.contextmanager
def fifo_fed(path: Path, data: bytes, chunk: int) -> Iterator[Path]:
    """``path`` made a FIFO that a thread feeds ``data`` into, ``chunk`` bytes a write: a non-seekable input,
    as ``--trace -`` or ``<(zcat t.gz)`` is."""
    os.mkfifo(path)

    def feed() -> None:
        try:
            with open(path, "wb", buffering=0) as f:
                for i in range(0, len(data), chunk):
                    f.write(data[i:i + chunk])
        except BrokenPipeError:
            pass  # the reader stopped early (a bad header): the rest is not needed

    writer = threading.Thread(target=feed, name="fuzz-fifo-writer", daemon=True)
    writer.start()
    try:
        yield path
    finally:
        trace.close_streams()  # the reader's end closes: a writer blocked on a full pipe gets EPIPE
        if writer.is_alive():  # a writer still waiting for a reader to open the FIFO: let it in, then out
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(TIME_BOUND_S)
        path.unlink()


# A process that writes a trace a piece at a time, naming itself as the header's writer (its pid).
_LIVE_WRITER = """
import os, sys, time
data = open(sys.argv[2], "rb").read().replace(b'"pid":4194303', b'"pid":%d' % os.getpid(), 1)
with open(sys.argv[1], "wb", buffering=0) as f:
    step = max(1, len(data) // 8)
    for i in range(0, len(data), step):
        f.write(data[i:i + step])
        time.sleep(0.02)
"""
LIVE_PID = 4194303  # the header pid the live writer replaces with its own (JSON Lines: "pid":4194303)


@contextlib.contextmanager
def written_live(path: Path, data: bytes) -> Iterator[subprocess.Popen]:
    """A process writing ``data`` to ``path`` in eight pieces over about 0.2 s, holding it open as it does,
    with its own pid in the header where ``data``'s says ``LIVE_PID``: a trace still being written."""
    source = path.with_name(path.name + ".src")
    source.write_bytes(data)
    path.write_bytes(b"")
    writer = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(path), str(source)])
    try:
        yield writer
    finally:
        writer.kill()
        writer.wait()
