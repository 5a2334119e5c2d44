"""Seconds from `./kvd watch --demo` to the demo's first token, as a user at a terminal sees it.

    .venv/bin/python benchmarks/first_token.py --runs 5     # warm: the model converted, files in the page cache

The command runs in a pseudo-terminal (the TUI draws into it; its output is read and dropped). The demo
child writes its trace into a new ``kvdoctor-watch-*`` directory under the temp dir; the first token is
the first ``step_end`` in that trace (the first step is every opening request's prefill and first token).
Then the TUI is stopped (SIGTERM to its process group) before the next run. Reports each run and the median.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import os
import pty
import select
import signal
import statistics
import struct
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_token_s(command: list[str], timeout_s: float) -> tuple[float | None, float | None]:
    """(seconds to the workload's directory, made just before the demo child starts; seconds to its first token)"""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvdoctor-watch-*")))
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of 120x40, as a user's
        os.chdir(ROOT)
        os.environ["TERM"] = "xterm-256color"
        os.execvp(command[0], command)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    found = started = None
    try:
        while time.perf_counter() - t0 < timeout_s and found is None:
            if select.select([fd], [], [], 0.01)[0]:
                try:
                    os.read(fd, 1 << 16)  # the screen: drained so the TUI never blocks on its terminal
                except OSError:
                    break
            for d in set(glob.glob(os.path.join(tempfile.gettempdir(), "kvdoctor-watch-*"))) - before:
                started = started or time.perf_counter() - t0
                trace = Path(d) / "workload.kvtrace"
                if trace.is_file() and b"step_end" in trace.read_bytes():
                    found = time.perf_counter() - t0
    finally:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if select.select([fd], [], [], 0.05)[0]:
                    os.read(fd, 1 << 16)
            except OSError:
                pass
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        os.close(fd)
    return started, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a first token")
    ap.add_argument("--command", default="./kvd watch --demo")
    args = ap.parse_args()
    times = []
    for i in range(args.runs):
        started, t = first_token_s(args.command.split(), args.timeout)
        print(f"run {i + 1}: demo started at {started or float('nan'):.2f} s, "
              + (f"first token at {t:.2f} s" if t is not None else f"no token in {args.timeout:.0f} s"), flush=True)
        if t is not None:
            times.append(t)
        time.sleep(1.0)  # the last run's processes gone before the next starts
    if times:
        print(f"median {statistics.median(times):.2f} s over {len(times)} runs (min {min(times):.2f}, max {max(times):.2f}); "
              f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
