"""``kvdoctor replay FILE``: the TUI's screens over a recorded trace, with pause, step and seek."""

from __future__ import annotations

import argparse

NAME = "replay"
HELP = "replay a recorded trace in the TUI: play, pause, step and seek by step (keys: p n b g)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help="check settings (default: [tool.kvdoctor] in the nearest pyproject.toml)")
    p.add_argument("trace", metavar="FILE", help="a .kvtrace (or .kvtrace.gz) file")
    p.add_argument("--speed", type=float, default=20.0, metavar="STEPS",
                   help="steps per second while playing; 0 plays to the end at once (default 20)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="open paused at step N (the state after step N)")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..errors import UsageError
    from ..trace import read_header

    if args.speed < 0:
        raise UsageError(f"--speed must be >= 0 steps per second; got {args.speed:g}")
    read_header(args.trace)  # missing or not a trace: one line and exit code 3, before the screen opens

    config = load_config(args.config)

    from ..tui.app import KvdoctorApp
    from ..tui.feed import ReplayFeed, suite_factory

    app = KvdoctorApp(lambda publish: ReplayFeed(
        args.trace, publish, speed=args.speed, start=args.step, checker_factory=suite_factory(config),
        limits=config.limits))
    app.run()
    return 0
