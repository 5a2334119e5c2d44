"""The Prometheus endpoint: `kvdoctor check --follow --metrics-port N` serves the cache's state
and the findings on 127.0.0.1 while a trace is still being written, scraped here over loopback."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from check_traces import HEADER, request, with_usage, write_trace

from kvdoctor import events as E
from kvdoctor.cli import main
from kvdoctor.metrics import CacheMetrics, metered
from kvdoctor.tui.feed import suite_factory
from kvdoctor.trace import TraceWriter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _first_steps() -> list[E.Event]:
    """Step 0: r1 leaks its swapped-out block; r7's blocks 7 and 8 are prefetched, only 7 is read."""
    return with_usage(request("r1", 1, step=0, leak=True)[:-1] + [
        E.Alloc(step=0, block=7, tier="host", seq="r7"), E.Alloc(step=0, block=8, tier="host", seq="r7"),
        E.Prefetch(step=0, blocks=[7, 8], src="host", dst="device"),
        E.Read(step=0, seq="r7", blocks=[7], versions=[0], layer=None),
        E.StepEnd(step=0)])


def test_scrape_while_a_trace_is_followed(tmp_path, capsys):
    # GIVEN a trace whose writer is still running, and check following it with a metrics port
    path = tmp_path / "live.kvtrace"
    writer = TraceWriter(path, HEADER)
    writer.write_many(_first_steps())
    writer._flush()
    port = _free_port()
    result: list[int] = []
    checker = threading.Thread(target=lambda: result.append(main([
        "check", "--trace", str(path), "--follow", "--metrics-port", str(port),
        "--format", "json", "-o", str(tmp_path / "out.json")])))
    checker.start()
    try:
        # WHEN the endpoint is scraped over loopback before the trace ends
        deadline, m = time.monotonic() + 20, {}
        while time.monotonic() < deadline:
            try:
                m = _scrape(port)
            except OSError:
                m = {}
            if m.get('kvdoctor_findings_total{check="leak",rule="unreachable-swapped",severity="error"}'):
                break
            time.sleep(0.05)
        # THEN it shows the tiers, the swap, the prefetch hits of the prefetched blocks and the live finding
        assert not writer.closed and checker.is_alive()
        assert m['kvdoctor_blocks{tier="host"}'] == 3 and m['kvdoctor_kv_bytes{tier="host"}'] == 3 * 4096
        assert m['kvdoctor_swaps_total{dst="host",src="device"}'] == 1
        assert m["kvdoctor_prefetched_blocks_total"] == 2 and m["kvdoctor_prefetch_hits_total"] == 1
        assert m['kvdoctor_findings_total{check="leak",rule="unreachable-swapped",severity="error"}'] == 1
        assert m["kvdoctor_events_total"] == len(_first_steps()) and m["kvdoctor_step"] == 0
    finally:
        writer.write_many(request("r2", 2, step=1))
        writer.close()
        checker.join(20)
    # AND the check ends with the trace and reports as usual
    assert result == [1]
    assert "KVDOCTOR SUMMARY: 1 errors" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "watch"])
def test_a_taken_port_is_one_line_and_exit_2(tmp_path, capsys, command):
    trace = write_trace(tmp_path / "t.kvtrace", request("r0", 0))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main([command, "--trace", str(trace), "--metrics-port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--metrics-port" in err


def test_prefix_hits_and_lookups_count_shared_blocks_of_all_blocks_got():
    # GIVEN two sequences where the second gets its first block by sharing the first's
    m = CacheMetrics()
    for ev in [E.Alloc(block=0, tier="device", seq="a"), E.Share(block=0, seq="b"),
               E.Alloc(block=1, tier="device", seq="b"), E.StepEnd(step=0)]:
        m.observe(ev)
    # THEN one block in three came from the prefix cache, as two counters a query divides over any window
    assert m.registry.get_sample_value("kvdoctor_prefix_hits_total") == 1
    assert m.registry.get_sample_value("kvdoctor_prefix_lookups_total") == 3


def test_no_metric_is_a_ratio_or_rate_a_scrape_would_freeze():
    # Prometheus's conventions: ratios are counter pairs, rates come from rate() over a counter
    names = {metric.name for metric in CacheMetrics().registry.collect()}
    assert not {n for n in names if n.endswith(("_rate", "_per_second"))}
    assert {"kvdoctor_prefetch_hits", "kvdoctor_prefetched_blocks", "kvdoctor_prefix_hits",
            "kvdoctor_prefix_lookups", "kvdoctor_events"} <= names


def test_the_tui_feeds_checker_also_counts_findings():
    # GIVEN the checker factory `watch --metrics-port` hands the TUI's feed
    m = CacheMetrics()
    checker = metered(suite_factory(), m)(HEADER)
    # WHEN the feed drives it over a leaking request and the end
    for ev in request("r1", 1, leak=True):
        checker.observe(ev)
    checker.finish()
    # THEN the leak is counted as a finding, and the swap
    assert m.registry.get_sample_value(
        "kvdoctor_findings_total", {"check": "leak", "rule": "unreachable-swapped", "severity": "error"}) == 1
    assert m.registry.get_sample_value("kvdoctor_swaps_total", {"src": "device", "dst": "host"}) == 1
