"""vLLM's own KV events as a kvdoctor trace: a lossy source for a vLLM you cannot add a plugin to.

vLLM publishes ``KVEventBatch`` messages over ZMQ when started with
``KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=..., topic=...)``:
``BlockStored`` (full blocks entering the prefix cache: their hashes, parent hash, token ids and
block size), ``BlockRemoved`` (hashes leaving it) and ``AllBlocksCleared``. This bridge
subscribes, maps them onto the v1 vocabulary and writes a trace, so ``kvdoctor watch`` and
``kvdoctor check`` follow it like any other workload:

    kvdoctor check --vllm-events tcp://127.0.0.1:5557       # = check -- python -m kvdoctor.integrations.vllm_events ...
    kvdoctor watch --vllm-events tcp://127.0.0.1:5557

What the events can say, and so what the trace holds: each stored hash becomes a block owned by
the prefix cache (``alloc`` + ``share`` with kvdoctor's content key of its token ids), a removed
hash its ``evict``. They say nothing of requests (no ``seq_start``, ownership or ``batch``), of
blocks that are never cached (a request's partial tail; they are freed without an event), of
block ids, reads, versions or attention. So only the accounting check (a hash removed that was
never stored: a lost or reordered event) and the prefix check (one vLLM hash naming two different
token contents: a hash collision or a wrong parent) have anything to judge; leak, stale, batch and
attention stay silent by construction, not because the run was clean.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from array import array
from typing import Any

import msgspec

from .. import knobs
from ..events import Alloc, Evict, Header, Share, StepEnd, TierSpec
from ..trace import TraceWriter

__all__ = ["KvEventsMapper", "bridge_argv", "main"]

PREFIX_CACHE = "prefix-cache"
_UNBOUNDED = 2**31 - 1  # the events never say how many blocks vLLM's pool has


class KvEventsMapper:
    """Turns decoded ``KVEventBatch`` payloads into v1 events; one ``step`` per batch."""

    def __init__(self) -> None:
        self.block_size: int | None = None
        self.step = 0
        self._t0 = time.perf_counter_ns()
        self._ids: dict[Any, int] = {}  # vLLM hash (bytes or int) -> kvdoctor block id
        self._copies: dict[Any, int] = {}  # vLLM hash -> blocks vLLM stored under it (duplicates are legal)
        self._keys: dict[Any, str] = {}  # vLLM hash -> content key of the tokens stored under it
        self._next_id = 1
        self.num_unknown_removals = 0  # removals of hashes stored before we subscribed

    def batch(self, payload: bytes) -> list:
        """The events of one published batch (``[ts, events, dp_rank]``, vLLM's array-like struct)."""
        decoded = msgspec.msgpack.decode(payload)
        events = decoded[1] if isinstance(decoded, list) else decoded.get("events", [])
        out: list = []
        for ev in events:
            kind = ev.get("type") if isinstance(ev, dict) else None
            if kind == "BlockStored":
                self._stored(ev, out)
            elif kind == "BlockRemoved":
                for h in ev.get("block_hashes", ()):
                    self._removed(_hashable(h), out)
            elif kind == "AllBlocksCleared":
                for h in list(self._copies):
                    self._copies[h] = 1
                    self._removed(h, out)
        out.append(self._event(StepEnd))
        self.step += 1
        return out

    def _event(self, cls: type, **fields: Any) -> Any:
        return cls(t=time.perf_counter_ns() - self._t0, step=self.step, **fields)

    def _stored(self, ev: dict, out: list) -> None:
        bs = ev.get("block_size") or self.block_size or 1
        self.block_size = self.block_size or bs
        tokens = ev.get("token_ids") or []
        parent = ev.get("parent_block_hash")
        key = self._keys.get(_hashable(parent)) if parent is not None else f"{ev.get('lora_name')}"
        for i, h in enumerate(ev.get("block_hashes", ())):
            h = _hashable(h)
            chunk = tokens[i * bs:(i + 1) * bs]
            key = None if key is None else hashlib.blake2b(
                key.encode() + array("q", chunk).tobytes(), digest_size=8).hexdigest()
            block = self._ids.get(h)
            if block is None:
                block = self._ids[h] = self._next_id
                self._next_id += 1
                out.append(self._event(Alloc, block=block, tier="device", seq=PREFIX_CACHE))
            self._copies[h] = self._copies.get(h, 0) + 1
            if key is not None:
                self._keys.setdefault(h, key)
                # The first share registers the hash's content; a later store under the same hash with
                # other tokens shares with another key, which the prefix check reports as a mismatch.
                out.append(self._event(Share, block=block, seq=PREFIX_CACHE, hash=key))

    def _removed(self, h: Any, out: list) -> None:
        copies = self._copies.get(h)
        if copies is None:
            self.num_unknown_removals += 1
            return
        if copies > 1:
            self._copies[h] = copies - 1
            return
        del self._copies[h]
        self._keys.pop(h, None)
        out.append(self._event(Evict, block=self._ids.pop(h), tier="device", reason="prefix-cache"))


def bridge_argv(endpoint: str, *, idle_exit: float = 0.0) -> list[str]:
    """The bridge as a workload kvdoctor starts (it writes ``$KVDOCTOR_TRACE``, which ``watch``/``check`` follow)."""
    argv = [sys.executable, "-m", "kvdoctor.integrations.vllm_events", endpoint]
    return argv + (["--idle-exit", str(idle_exit)] if idle_exit else [])


def _hashable(h: Any) -> Any:
    return tuple(h) if isinstance(h, list) else h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdoctor.integrations.vllm_events",
                                 description="subscribe to vLLM's KV events and write them as a kvdoctor trace")
    ap.add_argument("endpoint", help="vLLM's ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    ap.add_argument("--topic", default="", help="the topic vLLM publishes on (default: all)")
    ap.add_argument("--trace", default=knobs.get(knobs.TRACE), help="trace to write (default $KVDOCTOR_TRACE)")
    ap.add_argument("--idle-exit", type=float, default=0.0, metavar="S",
                    help="stop after S seconds without a message once events have arrived (default: run until stopped)")
    args = ap.parse_args(argv)
    if not args.trace:
        ap.error("no trace to write: give --trace FILE or set KVDOCTOR_TRACE")
    try:
        import zmq
    except ImportError:
        print("kvdoctor: vLLM's KV events need pyzmq: pip install 'kvdoctor[vllm-events]'", file=sys.stderr)
        return 2
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(args.endpoint)
    except zmq.ZMQError as exc:
        print(f"kvdoctor: cannot subscribe to {args.endpoint}: {exc}", file=sys.stderr)
        return 2
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    mapper, writer, pending, last = KvEventsMapper(), None, [], time.monotonic()
    try:
        while not stop:
            if not sub.poll(200):
                if args.idle_exit and writer is not None and time.monotonic() - last > args.idle_exit:
                    break
                continue
            frames = sub.recv_multipart()
            last = time.monotonic()
            pending += mapper.batch(frames[-1])
            if writer is None and mapper.block_size is not None:
                # The header needs the block size, which the first stored block tells.
                writer = TraceWriter(args.trace, Header(
                    block_size=mapper.block_size, num_layers=0, engine="vllm (KV events)", pid=os.getpid(),
                    tiers=[TierSpec(name="device", capacity_blocks=_UNBOUNDED)]))
            if writer is not None:
                writer.write_many(pending)
                pending = []
    except KeyboardInterrupt:
        pass
    finally:
        if writer is not None:
            writer.close()
        sub.close(0)
    if mapper.num_unknown_removals:
        print(f"kvdoctor: {mapper.num_unknown_removals} removals of blocks stored before subscribing were skipped",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
