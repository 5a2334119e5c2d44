"""``kvdoctor replay FILE…``: the TUI's screens over a recorded trace, with pause, step and seek.

Given a workload's traces (several files, a directory, a glob), the screens show one trace at a time:
``--pick`` chooses which (by its place in the workload or its file name); the others are listed."""

from __future__ import annotations

import argparse

NAME = "replay"
HELP = "replay a recorded trace in the TUI: play, pause, step and seek by step (keys: p n b g)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help="check settings (default: [tool.kvdoctor] in the nearest pyproject.toml)")
    p.add_argument("trace", metavar="FILE", nargs="+",
                   help="a .kvtrace (or .kvtrace.gz) file; several, a directory or a glob: a workload's traces")
    p.add_argument("--pick", metavar="N|NAME", default="1",
                   help="with several traces: which to replay, by its place (1, 2, ...) or file name (default 1)")
    p.add_argument("--speed", type=float, default=20.0, metavar="STEPS",
                   help="steps per second while playing; 0 plays to the end at once (default 20)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="open paused at step N (the state after step N)")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..errors import UsageError
    from ..trace import is_stdin, read_header

    if args.speed < 0:
        raise UsageError(f"--speed must be >= 0 steps per second; got {args.speed:g}")
    if args.step is not None and args.step < 0:
        raise UsageError(f"--step must be >= 0 (steps count from 0); got {args.step}")
    trace = _pick(args.trace, args.pick)
    if is_stdin(trace):
        raise UsageError("standard input is the screen's keyboard, so it cannot carry the trace: give a file, or a FIFO (mkfifo)")
    read_header(trace)  # missing or not a trace: one line and exit code 3, before the screen opens

    config = load_config(args.config)

    from ..tui.app import KvdoctorApp
    from ..tui.feed import ReplayFeed, suite_factory

    app = KvdoctorApp(lambda publish: ReplayFeed(
        trace, publish, speed=args.speed, start=args.step, checker_factory=suite_factory(config),
        limits=config.limits))
    app.run()
    return 0


def _pick(args: list[str], pick: str) -> str:
    """The one trace of ``args`` to replay; with several, says on standard error which and what else there is."""
    import os
    import sys

    from ..errors import UsageError
    from ..workload import trace_files

    paths = trace_files(args)
    if len(paths) == 1:
        return paths[0]
    if pick.isdigit() and 1 <= int(pick) <= len(paths):
        chosen = paths[int(pick) - 1]
    else:
        named = [p for p in paths if os.path.basename(p) == pick or p == pick]
        if not named:
            raise UsageError(f"--pick {pick}: choose 1-{len(paths)} or one of "
                             + ", ".join(os.path.basename(p) for p in paths))
        chosen = named[0]
    others = ", ".join(f"{i} {os.path.basename(p)}" for i, p in enumerate(paths, 1) if p != chosen)
    print(f"kvdoctor replay: {chosen} ({paths.index(chosen) + 1} of {len(paths)}; --pick another: {others})",
          file=sys.stderr)
    return chosen
