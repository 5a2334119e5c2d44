"""``kvdoctor profile -- CMD``: a py-spy flame graph (SVG) or speedscope profile of a workload.

py-spy starts the workload itself, so it is its parent: that is what Yama's default
ptrace_scope=1 permits without root. When ``--duration`` ends py-spy writes the profile
and stops the workload; without it, profiling lasts as long as the workload.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import UsageError

NAME = "profile"
HELP = "record a py-spy flame graph (SVG) or speedscope profile of a workload: kvdoctor profile -- python x.py"

FORMATS = {"flamegraph": ".svg", "speedscope": ".json"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-d", "--duration", type=float, metavar="S", help="seconds to record (default: until the workload exits)")
    p.add_argument("-f", "--format", choices=sorted(FORMATS), default="flamegraph",
                   help="flamegraph: an SVG to open in a browser; speedscope: JSON for speedscope.app (default flamegraph)")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write (default kvdoctor-profile-<time>.svg/.json)")
    p.add_argument("-r", "--rate", type=int, default=100, metavar="HZ", help="samples per second (default 100)")
    p.add_argument("--subprocesses", action="store_true", help="also profile the workload's child processes")
    p.add_argument("--trace", metavar="FILE", help="also record a kvdoctor trace with memory probes (sets KVDOCTOR_TRACE, KVDOCTOR_PROBES=1)")
    p.add_argument("--pid", type=int, help="profile a running process instead of starting CMD")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="the workload to run")


def run(args: argparse.Namespace) -> int:
    from ..probes.pyspy import PTRACE_FIX, record_command

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command and args.pid is None:
        raise UsageError("nothing to profile: give a workload after `--` (kvdoctor profile -- python x.py) "
                         "or a running process with --pid PID")
    if command and args.pid is not None:
        raise UsageError("give a workload after `--` or --pid PID, not both")
    if args.pid is not None and args.pid <= 0:
        raise UsageError(f"--pid must be a process id (> 0), got {args.pid}")
    if args.duration is not None and args.duration <= 0:
        raise UsageError(f"--duration must be > 0 seconds, got {args.duration:g}")
    if not 1 <= args.rate <= 10_000:
        raise UsageError(f"--rate must be 1..10000 samples per second, got {args.rate}")
    output = Path(args.output or f"kvdoctor-profile-{time.strftime('%Y%m%d-%H%M%S')}{FORMATS[args.format]}")
    env = dict(os.environ, RUST_LIB_BACKTRACE="0")  # py-spy's errors without a Rust backtrace
    if args.trace:
        env.update(KVDOCTOR_TRACE=str(Path(args.trace).resolve()), KVDOCTOR_PROBES="1")
    argv = record_command(output, fmt=args.format, duration_s=args.duration, rate_hz=args.rate,
                         subprocesses=args.subprocesses, pid=args.pid, command=command or None)
    # py-spy's stderr carries the workload's too: pass every line on, keep the last for the verdict.
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    tail: list[str] = []
    for line in proc.stderr:
        sys.stderr.write(line)
        tail = (tail + [line.strip()])[-20:]
    code = proc.wait()
    if code == 0 and output.is_file() and output.stat().st_size > 0:
        how = "open it in a browser" if args.format == "flamegraph" else "open it at https://www.speedscope.app"
        print(f"kvdoctor profile: wrote {output} ({how})", file=sys.stderr)
        return 0
    text = " ".join(tail).lower()
    if "permission denied" in text or "operation not permitted" in text:
        raise UsageError(f"py-spy was not permitted to read the workload; to fix: {PTRACE_FIX}")
    reason = next((line for line in tail if line.startswith("Error:")), f"py-spy exited with status {code}")
    raise UsageError(f"no profile written: {reason} (is the workload Python, and still running when py-spy attaches?)")
