"""``kvdoctor check``: run every check over a trace, a running workload or the demo; gate CI on it.

    kvdoctor check --trace run.kvtrace                  # a finished trace, or one still being written
    kvdoctor check -- python serve.py --requests 100    # start a workload with tracing on, check it live
    kvdoctor check --demo --fault leak-swapped          # the embedded model's demo workload
    kvdoctor check --pid 4242 --duration 60             # attach to a running process's kvdoctor engine
    kvdoctor check --trace run.kvtrace --format sarif --output kvdoctor.sarif --fail-on warning
    kvdoctor check --trace run.kvtrace --format html -o report.html   # one self-contained page for CI

Exit status: 0 no finding at or above --fail-on; 1 such findings; 2 usage or configuration
error; 3 an unreadable or incompatible trace.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import knobs
from ..demo import fault_options, model_setting
from ..faults import add_fault_argument

NAME = "check"
HELP = "check a trace, a running workload or the demo for KV-cache bugs (leaks, stale data, misaligned batches, attention anomalies)"

_DEMO_STEPS = 150


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("exit status: 0 ok, 1 findings at or above --fail-on, 2 usage or configuration error, "
                "3 unreadable or incompatible trace")
    src = p.add_argument_group("source (exactly one)")
    src.add_argument("--trace", metavar="FILE", nargs="+", action="extend",
                     help="trace files, directories of them or globs, checked as one workload (each trace on its "
                     "own, and the rules across traces over all); a trace is followed while its writer runs")
    src.add_argument("--demo", action="store_true", help="run the embedded model's demo workload and check it")
    src.add_argument("--pid", type=int, metavar="PID",
                     help="attach to a running process whose kvdoctor engine runs steps: its caches trace from their "
                     "next step's end (a snapshot of what they hold first), checked until it exits, --duration ends "
                     "or Ctrl-C; then it stops tracing (docs/cli.md)")
    src.add_argument("--vllm-events", metavar="ENDPOINT",
                     help="vLLM's ZMQ KV-event publisher (tcp://HOST:PORT): check what its events can show, until "
                     "Ctrl-C or --idle-exit seconds without an event (docs/integrations.md)")
    src.add_argument("workload", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                     help="a workload to start with KVDOCTOR_TRACE set, checked as it runs (every trace it writes)")
    p.add_argument("--follow", action="store_true",
                   help="with --trace: keep following the files until their writers close them (or Ctrl-C); "
                   "a directory's new trace files join as they appear")
    p.add_argument("--idle-exit", type=float, default=0.0, metavar="S",
                   help="with --vllm-events: stop after S seconds without an event (default: until Ctrl-C)")
    p.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="with --trace --follow: seconds to wait for the file to appear; with --pid: for the process "
                   "to answer (default 10)")
    p.add_argument("--duration", type=float, metavar="S",
                   help="with --pid: check S seconds of the process's work, then detach and report")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="serve Prometheus metrics (tiers, swaps, prefix and prefetch hits, findings, events; docs/integrations.md) on 127.0.0.1:N "
                        "while checking; with --trace --follow, headless monitoring of a serving process")
    add_fault_argument(p, applies="with --demo or a command: ")
    p.add_argument("--verify", choices=knobs.VERIFY_MODES,
                   help="with --demo or a command: check the engine's K/V content digests on every read (full: CI), "
                   "a sample of reads (sample: the default; full with a content fault) or none (off) (KVDOCTOR_VERIFY)")
    p.add_argument("--model", metavar="tiny|PATH", type=model_setting,
                   help="with --demo: 'tiny' random model or a local checkpoint")
    p.add_argument("--prefix-cache", action="store_true",
                   help="with --demo: automatic prefix caching, every request opening with one chat system prompt "
                   "(implied by a prefix-* fault)")
    p.add_argument("--steps", type=int, default=_DEMO_STEPS, help=f"with --demo: engine steps to run (default {_DEMO_STEPS})")
    p.add_argument("--fail-on", choices=("error", "warning", "info"),
                   help="lowest severity that fails the run (default: error, or fail_on in the config)")
    p.add_argument("--format", choices=("text", "json", "junit", "sarif", "html"), default="text",
                   help="html: one self-contained page (findings, block histories, plots over steps) for CI artifacts")
    p.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of standard output")
    p.add_argument("--config", metavar="FILE.toml", help="settings file (default: [tool.kvdoctor] in the nearest pyproject.toml)")
    p.add_argument("--attention-profile", metavar="FILE|auto|none",
                   help="normal attention ranges of the model (`kvdoctor attention-profile`); auto: the one "
                        "kvdoctor ships for the trace's model, if any; none: learn them from the trace itself")
    p.add_argument("--disable", action="append", metavar="RULE", help="switch off a check or check/rule (repeatable)")
    p.add_argument("--baseline", metavar="FILE", help="accept the findings listed in this baseline")
    p.add_argument("--write-baseline", metavar="FILE", help="write the findings of this run as a baseline and exit 0")
    p.add_argument("--list-rules", action="store_true", help="list every check/rule with its severity and exit")


def run(args: argparse.Namespace) -> int:
    from ..stop_signals import interrupt_on_stop_signals, reraise

    # SIGTERM/SIGHUP (a CI timeout, a closed terminal) act as Ctrl-C: the workload is stopped, the
    # report printed; then kvdoctor dies of the signal, so the sender sees it did.
    with interrupt_on_stop_signals() as received:
        code = _check(args)
    reraise(received)
    return code


def _check(args: argparse.Namespace) -> int:
    from ..config import load_config
    from ..errors import UsageError
    from ..findings import Finding
    from ..report import load_baseline, render, summary_line, write_baseline
    from ..workload import TraceSet, WorkloadSession

    if args.list_rules:
        return _list_rules()
    command = list(args.workload or [])
    if command and command[0] == "--":
        command = command[1:]
    chosen = [name for name, on in (("--trace", args.trace), ("--demo", args.demo), ("a command", command),
                                    ("--vllm-events", args.vllm_events), ("--pid", args.pid is not None)) if on]
    if len(chosen) != 1:
        raise UsageError("give exactly one source: --trace FILE, --demo, --pid PID, --vllm-events ENDPOINT, or -- CMD "
                         "ARGS..." + (f" (got {' and '.join(chosen)})" if chosen else ""))
    if args.duration is not None and (args.pid is None or args.duration <= 0):
        raise UsageError("--duration takes a positive number of seconds, with --pid")
    if args.pid is not None and (args.fault or args.verify):
        raise UsageError("--fault and --verify apply to a workload kvdoctor starts; a process attached to runs as it was started")
    if args.fault and args.trace:
        raise UsageError("--fault applies to --demo or a command; a trace was recorded with whatever faults it had")
    if args.prefix_cache and not args.demo:
        raise UsageError("--prefix-cache applies to --demo only (a workload of your own switches it on in its engine)")
    if args.verify and args.trace:
        raise UsageError("--verify applies to --demo or a command; a trace holds the digests its engine emitted")
    content_fault = False
    if args.fault:
        from ..engine.faults import CONTENT_FAULTS, FAULTS  # light: no torch

        if args.fault not in FAULTS:
            raise UsageError(f"unknown fault {args.fault!r}: use one of {', '.join(FAULTS)}")
        content_fault = args.fault in CONTENT_FAULTS
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise UsageError(f"--metrics-port must be 1-65535, got {args.metrics_port}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")

    config = load_config(args.config).with_overrides(fail_on=args.fail_on, disable=args.disable,
                                                     attention_profile=args.attention_profile)
    baseline_path = args.baseline or (config.baseline if not args.write_baseline else None)
    baseline = load_baseline(baseline_path) if baseline_path else None

    verify = args.verify
    if verify is None and content_fault:
        verify = "full"  # a fault shown on purpose should be caught at its first read, not at a sampled one
    env = dict(os.environ, **{knobs.VERIFY.name: verify}) if verify else None
    if args.trace:
        source = TraceSet.open(args.trace, follow=True if args.follow else None, wait_s=args.wait)
        if not args.follow:
            _say_which_are_live(source.paths)
    elif args.demo:
        argv = [sys.executable, "-m", "kvdoctor.demo", "--steps", str(args.steps)]
        if args.model:
            argv += ["--model", args.model]
        argv += fault_options(args.fault)  # what the fault needs to fire; one that cannot is refused
        if args.prefix_cache and "--prefix-cache" not in argv:
            argv += ["--prefix-cache"]
        source = TraceSet.command(argv, fault=args.fault, env=env)
        source.name = "kvdoctor demo" + (f" --fault {args.fault}" if args.fault else "")
    elif args.pid is not None:
        from ..pid_source import ProcessTraces

        source = ProcessTraces(args.pid, wait_s=args.wait)
        source.attach(args.wait)
        if args.duration is not None:
            source.detach_after(args.duration)
    elif args.vllm_events:
        from ..integrations.vllm_events import bridge_argv

        source = TraceSet.command(bridge_argv(args.vllm_events, idle_exit=args.idle_exit))
        source.name = f"vLLM KV events at {args.vllm_events}"
    else:
        source = TraceSet.command(command, fault=args.fault, env=env)

    session = WorkloadSession(source, config)
    series = metrics = None
    if args.format == "html":
        from ..report_html import StepSeries

        series = StepSeries()  # the plots need per-step series the report does not keep
    if args.metrics_port is not None:
        from ..metrics import CacheMetrics

        metrics = CacheMetrics()
        metrics.serve(args.metrics_port)
        print(f"kvdoctor check: metrics on http://127.0.0.1:{args.metrics_port}/metrics", file=sys.stderr)
    try:
        if series is None and metrics is None:
            session.run()
        else:
            for event, found in session:
                if event is not None:
                    if series is not None:
                        series.observe(event)
                    if metrics is not None:
                        metrics.observe(event)
                if metrics is not None and found:
                    metrics.add_findings(found)
    except KeyboardInterrupt:
        session.stop()
        session.close()
        print("kvdoctor check: interrupted; reporting what was checked so far", file=sys.stderr)
    if source.returncode not in (0, None):
        session.add([Finding(
            check="workload", rule="exit-status", severity="error",
            message=f"{source.exit_message()}: {source.name}", evidence={"returncode": source.returncode},
        )])

    if args.write_baseline:
        n = write_baseline(args.write_baseline, session.findings)
        print(f"kvdoctor check: wrote {n} findings to baseline {args.write_baseline}", file=sys.stderr)
        return 0

    report = session.report(fail_on=config.fail_on, baseline=baseline)
    if args.format == "html":
        from ..report_html import render_html

        text = render_html(report, series)
    else:
        text = render(report, args.format)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    if args.output or args.format != "text":
        print(summary_line(report), file=sys.stderr)
    return report.exit_code


def _say_which_are_live(paths: list[str]) -> None:
    """A trace whose writer still runs is followed until it closes: say so, or the wait looks like a hang."""
    from ..session import _writer_alive
    from ..trace import input_path, read_header

    for path in paths:
        pid = read_header(path).pid
        if pid is not None and pid != os.getpid() and _writer_alive(input_path(path), pid):
            print(f"kvdoctor check: {path} is still being written (pid {pid}); checking it as it grows until "
                  "its writer closes it or exits (Ctrl-C reports what was checked so far)", file=sys.stderr)


def _list_rules() -> int:
    from ..checks import RULES

    width = max(len(r) for r in RULES)
    for rid, rule in RULES.items():
        print(f"{rid:{width}}  {rule.severity:7}  {rule.summary}")
    return 0
