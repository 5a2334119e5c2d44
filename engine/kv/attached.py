"""A cache's trace switched on from outside, while it runs: ``kvdoctor watch|check --pid`` (``kvdoctor.attach``).

Every cache listens at its step ends, attached or not, for the price of a clock read (the request file is
looked at every ``attach.POLL_S`` for the whole process). A step's end is the one moment the cache is
whole: nothing reserved and not committed, the bus just flushed. There the trace begins with a
``snapshot`` of what the cache holds, so the checks start from it; the bus then carries every event on.
Nothing here may fail the engine: an error stops the listening with one line on stderr.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

from ... import attach
from ...events import PREFIX_CACHE, SnapBlock, Snapshot, SnapSeq

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["AttachedTrace", "snapshot"]


def snapshot(cache: PagedKVCache) -> Snapshot:
    """The cache as its untraced history left it: each live sequence, each allocated block with its live
    owners (none: a block already leaked), the positions its writes left and its prefix-cache key."""
    live = cache.seqs
    bs = cache.block_size
    keys = cache.prefix.keys if cache.prefix is not None else {}
    blocks = []
    for b in cache.pool.blocks.values():
        owners = [o for o in b.owners if o in live or o == PREFIX_CACHE]
        writer = next((o for o in owners if o in live), None)
        pos = b.index * bs
        if writer is not None:
            n = max(0, min(bs, live[writer].length - pos))
        else:
            n = bs if owners else 0  # the prefix cache registers full blocks only; a leaked block's are unknown
        seq = writer if writer is not None else (owners or b.owners or [PREFIX_CACHE])[0]
        blocks.append(SnapBlock(block=b.id, tier=b.tier, owners=owners, seq=seq, pos=pos, n=n, version=b.version,
                                codec=b.codec or None, hash=keys.get(b.id)))
    seqs = [SnapSeq(seq=s.id, prompt_len=s.prompt_len, length=s.length, version=s.version) for s in live.values()]
    bus = cache.bus
    return Snapshot(t=bus.now(), step=bus.step, seqs=seqs, blocks=blocks)


class AttachedTrace:
    """The trace a standing attach request asks of one cache: opened at a step's end, closed when the request
    goes (or the cache closes)."""

    def __init__(self, cache: PagedKVCache, name: Callable[[str], str]) -> None:
        self.cache = cache
        self._name = name  # the file a trace asked to go to ``path`` takes (the run's next, as the environment's)
        self._writer: Any = None
        self._key: str | None = None  # the request the open trace answers
        self._failed = False
        cache.bus.after_step(self.poll)

    def poll(self) -> None:
        if self._failed:
            return
        try:
            request = attach.standing()
            if request is not None and request.key != self._key:
                self._open(request)
            elif request is None and self._key is not None:
                self.close("detached")
        except Exception as exc:  # the host's inference goes on; only the attaching stops
            self._failed = True
            print(f"kvdoctor: attaching a trace failed and stopped ({type(exc).__name__}: {exc}); "
                  "inference is not affected", file=sys.stderr)
            self.close("attach failed")

    def _open(self, request: attach.Request) -> None:
        from ...trace import TraceWriter

        self.close("detached")  # a trace for an earlier request
        cache = self.cache
        path = self._name(request.trace)
        writer = TraceWriter(path, cache.header())
        snap = snapshot(cache)
        writer.write_many([snap])  # first, before anything the bus carries
        cache.bus.subscribe(writer.write_many)
        self._writer, self._key = writer, request.key
        attach.answer(request, path, snap.step, len(snap.blocks), len(snap.seqs))

    def close(self, reason: str = "closed") -> None:
        writer, self._writer, self._key = self._writer, None, None
        if writer is None:
            return
        try:
            self.cache.bus.unsubscribe(writer.write_many)
        finally:
            writer.close(reason)
