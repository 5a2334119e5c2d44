"""A leak found in a user's workload names the line of the user's script that allocated the block, in text,
SARIF and JUnit, with the same fingerprint on every run (issue 33's goal)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET

import pytest

from kvdoctor.cli import main

pytest.importorskip("torch")

SCRIPT = '''
import torch
from kvdoctor.engine import EngineConfig, PagedKVCache

LAYERS, HEADS, DIM = 2, 2, 8


def append(cache, seq, n):
    slots = cache.reserve(seq, n)  # ALLOC
    for layer in range(LAYERS):
        kv = torch.randn(n, HEADS, DIM)
        cache.store(layer, slots, kv, kv)
    cache.commit(seq)


def main():
    cfg = EngineConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, block_size=4, dtype="float32",
                       device_blocks=24, host_blocks=12, disk_blocks=0)
    cache = PagedKVCache(cfg)
    cache.add_sequence("req-A", prompt_len=12)
    append(cache, "req-A", 12)
    cache.swap_out(cache.block_table("req-A")[:1], dst="host")
    cache.end_step(12)
    cache.remove_sequence("req-A", reason="aborted")  # ABORT
    cache.end_step(0)
    cache.close()


main()
'''


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if f"# {marker}" in line)


def _check(capsys, fmt: str) -> str:
    code = main(["check", "--fault", "leak-swapped", "--format", fmt, "--", sys.executable, "serve.py"])
    out = capsys.readouterr().out
    assert code == 1, out
    return out


def test_a_leak_names_the_users_allocating_line_in_every_format_and_keeps_its_fingerprint(tmp_path, monkeypatch,
                                                                                          capsys):
    # GIVEN a user's script that aborts a request whose block was swapped out, on an engine that forgets it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "serve.py").write_text(SCRIPT)
    alloc, abort = _line("ALLOC"), _line("ABORT")
    # WHEN kvdoctor checks the workload
    text = _check(capsys, "text")
    # THEN the text names where the block was allocated and where the request was aborted
    assert f"        allocated at serve.py:{alloc} in append <- serve.py:" in text
    assert f"        sequence ended at serve.py:{abort} in main <- serve.py:" in text
    # AND SARIF's primary location is that line, JUnit's case carries it
    first, second = (json.loads(_check(capsys, "sarif"))["runs"][0]["results"] for _ in range(2))
    assert first[0]["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "serve.py"}, "region": {"startLine": alloc}}
    case = next(c for c in ET.fromstring(_check(capsys, "junit").split("\n", 1)[1]).iter("testcase")
                if c.find("failure") is not None)
    assert (case.get("file"), case.get("line")) == ("serve.py", str(alloc))
    # AND two runs give the same fingerprints
    assert [r["partialFingerprints"] for r in first] == [r["partialFingerprints"] for r in second]
    assert f"at=serve.py:{alloc}" in first[0]["partialFingerprints"]["kvdoctor/v2"]
