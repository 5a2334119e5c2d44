"""``kvdoctor export TRACE --perfetto OUT.json``: a trace in a format other tools show.

    kvdoctor export run.kvtrace --perfetto run.json    # open run.json in ui.perfetto.dev or chrome://tracing
    kvdoctor export traces/ --perfetto run.json         # every trace of a workload: a process each, one timeline

Exit status: 0 written; 2 usage error (an unwritable output); 3 an unreadable trace.
"""

from __future__ import annotations

import argparse
import sys

NAME = "export"
HELP = "export a trace for other tools: --perfetto OUT.json (steps, tier counters, transfers, findings) for ui.perfetto.dev"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", nargs="+",
                   help="a .kvtrace (or .kvtrace.gz) file; several, a directory or a glob: one workload, a process "
                   "per trace on one wall-clock timeline")
    p.add_argument("--perfetto", metavar="OUT.json", required=True,
                   help="write Chrome trace-event JSON here (ui.perfetto.dev, chrome://tracing)")
    p.add_argument("--config", metavar="FILE.toml",
                   help="check settings for the findings (default: [tool.kvdoctor] in the nearest pyproject.toml)")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..errors import UsageError
    from ..export import export_perfetto
    from ..trace import read_header

    from ..workload import trace_files

    for path in trace_files(args.trace):
        read_header(path)  # missing or not a trace: one line and exit code 3 before any output
    config = load_config(args.config)
    try:
        n = export_perfetto(args.trace, args.perfetto, config)
    except OSError as exc:
        raise UsageError(f"cannot write {args.perfetto}: {exc.strerror}") from None
    print(f"kvdoctor export: wrote {n} trace events to {args.perfetto}", file=sys.stderr)
    return 0
