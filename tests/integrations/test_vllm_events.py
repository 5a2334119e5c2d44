"""vLLM's KV events mapped into a trace: what they can show is judged, and a clean stream is silent.

The payloads are built the way vLLM's ZMQ publisher encodes them (msgpack of an array-like
``KVEventBatch`` whose events are tagged maps), so these run without vLLM installed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import msgspec
import pytest

from kvdoctor.checks import make_suite
from kvdoctor.events import Alloc, Evict, Share
from kvdoctor.integrations.vllm_events import KvEventsMapper, bridge_argv


def _payload(*events) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


def _stored(hashes, tokens, parent=None, block_size=4):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}


def _removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def _check(events):
    suite = make_suite()
    return suite.observe_many(events) + suite.finish()


def test_stored_and_removed_blocks_become_the_prefix_caches_blocks_and_a_clean_stream_is_silent():
    # GIVEN two requests' blocks stored (one chained on the other), a duplicate store, removals and a clear
    m = KvEventsMapper()
    events = m.batch(_payload(_stored([b"h1", b"h2"], [1, 2, 3, 4, 5, 6, 7, 8])))
    events += m.batch(_payload(_stored([b"h3"], [9, 9, 9, 9], parent=b"h2"), _stored([b"h1"], [1, 2, 3, 4])))
    events += m.batch(_payload(_removed([b"h1"]), _removed([b"h3"])))
    events += m.batch(_payload({"type": "AllBlocksCleared"}))
    # THEN each hash is one block of the prefix cache, evicted when its last copy goes, and nothing is found
    assert [type(e) for e in events if type(e) in (Alloc, Evict)] == [Alloc, Alloc, Alloc, Evict, Evict, Evict]
    assert m.block_size == 4 and _check(events) == []


def test_one_hash_naming_two_token_contents_is_a_prefix_hash_mismatch():
    # GIVEN vLLM stores h1 for tokens 1..4, and (a hash collision) h1 again for other tokens
    m = KvEventsMapper()
    events = m.batch(_payload(_stored([b"h1"], [1, 2, 3, 4])))
    events += m.batch(_payload(_stored([b"h1"], [4, 3, 2, 1])))
    findings = _check(events)
    assert [f.rule for f in findings] == ["hash-mismatch"] and findings[0].check == "prefix"
    keys = [e.hash for e in events if type(e) is Share]
    assert len(set(keys)) == 2


def test_removals_of_blocks_stored_before_subscribing_are_counted_not_reported():
    m = KvEventsMapper()
    events = m.batch(_payload(_removed([b"never-seen"])))
    assert m.num_unknown_removals == 1 and _check(events) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvdoctor_check_follows_a_live_publisher_over_zmq(tmp_path):
    zmq = pytest.importorskip("zmq")
    # GIVEN a PUB socket on loopback publishing like vLLM, and kvdoctor check subscribed to it
    port = _free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    proc = subprocess.Popen([sys.executable, "-m", "kvdoctor.cli", "check", "--vllm-events",
                             f"tcp://127.0.0.1:{port}", "--idle-exit", "2", "--format", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)  # ZMQ's slow joiner: a subscriber misses what is published before it connected
        for i in range(5):
            pub.send_multipart([b"", i.to_bytes(8, "big"), _payload(_stored([f"h{i}".encode()], [i, i, i, i]))])
            time.sleep(0.1)
        pub.send_multipart([b"", b"\0" * 8, _payload(_stored([b"h0"], [7, 7, 7, 7]))])  # a collision
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        pub.close(0)
    # THEN the run ends on its own and reports the collision (exit 1 for an error finding)
    import json

    report = json.loads(out)
    assert proc.returncode == 1, err
    assert [f["rule"] for f in report["findings"]] == ["hash-mismatch"]


def test_bridge_argv_runs_this_interpreter():
    assert bridge_argv("tcp://127.0.0.1:1", idle_exit=3)[:3] == [sys.executable, "-m", "kvdoctor.integrations.vllm_events"]
