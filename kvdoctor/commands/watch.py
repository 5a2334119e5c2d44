"""``kvdoctor watch``: the live TUI over a workload's KV cache, as it runs.

Sources: ``--demo`` (the embedded model serving a stream of chat requests, in a child
process), ``-- CMD ARGS…`` (your workload, started with tracing switched on: every trace it
writes, each cache's and each process's, joins the screen as it appears), ``--trace FILE``
(a trace another process is writing; several, or a directory: a workload's traces) and
``--pid PID`` (a process already running). The workload always runs in its own process and
writes trace files that the TUI follows, so a slow step never freezes the screen and a crash
leaves the last state on it. A workload of several traces shows one at a time, with a
selector (t / T), and the findings of all of them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..compression import CODEC_HELP, CODEC_METAVAR, codec_setting
from ..demo import fault_options, model_setting
from ..faults import add_fault_argument

NAME = "watch"
HELP = "live TUI of a workload's KV cache: --demo [--fault NAME], --trace FILE, or -- CMD ARGS"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help="check settings (default: [tool.kvdoctor] in the nearest pyproject.toml)")
    src = p.add_argument_group("source (exactly one)")
    src.add_argument("--demo", action="store_true",
                     help="run the embedded SmolLM2 serving a continuous stream of chat requests")
    src.add_argument("--trace", metavar="FILE", nargs="+",
                     help="follow a trace file that another process is writing; several files or a directory: a "
                     "workload's traces, every one checked, one shown at a time (t / T switch)")
    src.add_argument("--pid", type=int, metavar="PID",
                     help="attach to a running process whose kvdoctor engine runs steps: its first cache traces from "
                     "its next step's end (a snapshot of what it holds first) until the screen closes")
    src.add_argument("--vllm-events", metavar="ENDPOINT",
                     help="vLLM's ZMQ KV-event publisher (tcp://HOST:PORT); see docs/integrations.md")
    add_fault_argument(p, applies="with --demo or -- CMD: ")
    p.add_argument("--model", metavar="PATH", type=model_setting,
                   help="with --demo: a local Hugging Face checkpoint, or 'tiny' for a small random model "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--codec", type=codec_setting, metavar=CODEC_METAVAR,
                   help="with --demo: " + CODEC_HELP + ". The block detail then shows each block's codec")
    p.add_argument("--prefix-cache", action="store_true",
                   help="with --demo: automatic prefix caching; every request opens with one chat system prompt, "
                        "so the header shows the hit rate and the block map the cached blocks (implied by a prefix-* fault)")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="how long to wait for the trace to appear (default 10 s; 300 s for a workload we start, "
                        "which stops waiting as soon as the workload exits)")
    p.add_argument("--keep-trace", action="store_true",
                   help="with --demo or -- CMD: keep the workload's trace and log after the screen closes, to replay "
                        "or check later (default: removed from the temp folder)")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="also serve Prometheus metrics (tiers, swaps, prefix and prefetch hits, findings, events; docs/integrations.md) on 127.0.0.1:N")
    p.add_argument("workload_argv", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="a workload to start with KVDOCTOR_TRACE set, e.g. -- python my_script.py")


def run(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..errors import UsageError
    from ..trace import input_path, is_stdin, wait_header

    command = list(args.workload_argv or [])
    if command[:1] == ["--"]:
        command = command[1:]
    if args.vllm_events:
        if command:
            raise UsageError("choose exactly one source: --vllm-events and -- CMD")
        from ..integrations.vllm_events import bridge_argv

        command = bridge_argv(args.vllm_events)  # the bridge is a workload that writes the trace the TUI follows
    chosen = [name for name, on in (("--demo", args.demo), ("--trace", args.trace), ("-- CMD", command),
                                    ("--pid", args.pid is not None)) if on]
    if len(chosen) != 1:
        what = "nothing" if not chosen else " and ".join(chosen)
        raise UsageError(f"choose exactly one source (got {what}): --demo, --trace FILE, --pid PID, or -- CMD ARGS")
    if args.pid is not None:
        return _watch_process(args)
    if args.fault and args.trace:
        raise UsageError("--fault applies to a workload kvdoctor starts (--demo or -- CMD), not to --trace")
    if args.model and not args.demo:
        raise UsageError("--model applies to --demo only")
    if args.codec and not args.demo:
        raise UsageError("--codec applies to --demo only (a workload of your own sets its engine's codec itself)")
    if args.prefix_cache and not args.demo:
        raise UsageError("--prefix-cache applies to --demo only (a workload of your own switches it on in its engine)")
    if args.keep_trace and args.trace:
        raise UsageError("--keep-trace applies to a workload kvdoctor starts (--demo or -- CMD); --trace FILE is yours")
    if args.fault:
        from ..engine.faults import FAULTS

        if args.fault not in FAULTS:
            raise UsageError(f"unknown fault {args.fault!r}: choose one of {', '.join(FAULTS)}")
    if args.trace and not isinstance(args.trace, str):  # --trace as given: one file, several, a directory
        if len(args.trace) > 1 or os.path.isdir(args.trace[0]):
            return _watch_workload(args)
        args.trace = args.trace[0]
    if args.trace and is_stdin(args.trace):
        raise UsageError("--trace: standard input is the screen's keyboard, so it cannot carry the trace: give a file, or a FIFO (mkfifo)")
    if args.trace:
        # A missing file or one that is not a trace fails here, as one line and exit 3, before the screen opens;
        # a writer that is about to create it gets --wait seconds.
        wait = args.wait if args.wait is not None else 10.0
        if not os.path.exists(input_path(args.trace)):
            print(f"kvdoctor watch: waiting up to {wait:g} s for {args.trace} to appear", file=sys.stderr)
        wait_header(args.trace, wait)

    config = load_config(args.config)
    metrics = _serve_metrics(args)

    # The workload starts before the screen's modules load: a model's load then overlaps the TUI's.
    from ..tui.workload import Workload

    workload = None
    if args.demo:
        workload = Workload.demo(fault=args.fault, model=args.model, codec=args.codec, prefix_cache=args.prefix_cache,
                                 options=fault_options(args.fault, args.codec))  # one the demo cannot reach: refused
    elif command:
        workload = Workload(command, fault=args.fault)
    try:
        if command:
            _watch_command(workload, args, config, metrics)
        else:
            _run_screen(args, config, metrics, workload)
    finally:
        if workload is not None:
            workload.stop()
            ending = workload.exit_message()  # before its log goes: a crash quotes the log's last line
            if not args.keep_trace:
                workload.remove()  # nothing left behind in the temp folder
    if workload is not None and args.keep_trace:
        # The trace outlives the screen: the same session can be replayed or checked later.
        kept = workload.trace.parent if command else workload.trace
        print(f"{ending}; its trace{'s' if command else ''}: {kept} "
              f"(kvdoctor replay {kept}, kvdoctor check --trace {kept})", file=sys.stderr)
    elif workload is not None:
        print(f"{ending} (--keep-trace keeps its trace to replay or check)", file=sys.stderr)
    return 0


def _watch_process(args: argparse.Namespace) -> int:
    """``--pid``: the screen shows the traces the process's caches write once attached (a selector when it has
    several, as for a workload's traces); closing the screen takes the request back, so the process stops
    tracing."""
    from ..errors import UsageError
    from ..pid_source import ProcessTraces

    if args.fault or args.keep_trace or args.model or args.codec or args.prefix_cache or args.metrics_port:
        raise UsageError("--fault, --keep-trace, --model, --codec, --prefix-cache and --metrics-port apply to a "
                         "workload kvdoctor starts or a trace; a process attached to runs as it was started")
    source = ProcessTraces(args.pid, wait_s=10.0)
    try:
        source.attach(args.wait if args.wait is not None else 10.0)
        _show_workload(source, args)
    finally:
        source.close()
    return 0


def _watch_workload(args: argparse.Namespace) -> int:
    """``--trace`` naming several traces or a directory: every trace checked, on its own and across the others;
    the screen shows one trace's state at a time and the findings of all of them. A trace that appears in the
    directory while the others are still written joins them."""
    from ..config import load_config
    from ..workload import TraceSet

    config = load_config(args.config)
    traces = TraceSet.open(args.trace, wait_s=args.wait if args.wait is not None else 10.0,
                           alive=lambda: traces.writers_alive())  # a process still writing may open another cache
    _show_workload(traces, args, config, _serve_metrics(args))
    return 0


def _watch_command(workload: Any, args: argparse.Namespace, config: Any, metrics: Any) -> None:
    """``-- CMD``: every trace the workload writes (a second cache, another process: ``run.2.kvtrace`` …) joins the
    screen as it appears, with the trace selector once there are two; the first is waited for until the workload
    exits (up to ``--wait``)."""
    from ..workload import TraceSet

    wait = args.wait if args.wait is not None else 300.0
    traces = TraceSet.of_child(workload, str(workload.trace.parent), name=workload.title, wait_s=wait)
    _show_workload(traces, args, config, metrics, workload=workload)


def _show_workload(traces: Any, args: argparse.Namespace, config: Any = None, metrics: Any = None,
                   workload: Any = None) -> None:
    """A screen over every trace of ``traces``, each checked on its own and across the others."""
    from ..config import load_config
    from ..tui.app import workload_app

    config = config if config is not None else load_config(args.config)
    workload_app(traces, config, workload=workload, metrics=metrics).run()


def _serve_metrics(args: argparse.Namespace) -> Any:
    """``--metrics-port``'s metrics, served before the screen opens (a taken port is one line, exit 2), or None."""
    from ..errors import UsageError

    if args.metrics_port is None:
        return None
    if not 0 < args.metrics_port < 65536:
        raise UsageError(f"--metrics-port must be 1-65535, got {args.metrics_port}")
    from ..metrics import CacheMetrics

    metrics = CacheMetrics()
    metrics.serve(args.metrics_port)
    return metrics


def _run_screen(args: argparse.Namespace, config: Any, metrics: Any, workload: Any) -> None:
    """The demo's screen, or one trace followed (``--trace FILE``)."""
    from ..tui.app import KvdoctorApp
    from ..tui.feed import LiveFeed, suite_factory

    checker_factory = suite_factory(config)
    if metrics is not None:
        from ..metrics import metered

        checker_factory = metered(checker_factory, metrics)
    path = str(workload.trace) if workload is not None else args.trace
    wait = args.wait if args.wait is not None else (300.0 if workload is not None else 10.0)
    app = KvdoctorApp(
        lambda publish: LiveFeed(path, publish, workload=workload, wait_s=wait,
                                 checker_factory=checker_factory, limits=config.limits),
        workload=workload,
    )
    app.run()
