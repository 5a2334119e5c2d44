"""The Python heap through tracemalloc, kept cheap, and where it grew.

tracemalloc costs something on every allocation, more with every frame it records,
so the probe records few frames (``DEFAULT_FRAME_LIMIT``) and starts tracing only
when asked: what was allocated before is not traced, which keeps snapshots small.
Growth is attributed to the innermost frame that is *not* the standard library or
kvdoctor's own probes, because "list.append in json/decoder.py" says nothing while
"the line of yours that called it" does. torch's tensor memory is invisible here
(its allocator is not Python's); ``torch_mem`` covers that.
"""

from __future__ import annotations

import os
import sysconfig
import tracemalloc
from dataclasses import dataclass

__all__ = ["DEFAULT_FRAME_LIMIT", "Site", "HeapProbe", "top_growth"]

DEFAULT_FRAME_LIMIT = 4

# Allocation made by the machinery, never by the code under diagnosis.
_SNAPSHOT_FILTERS = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"]) + os.sep
_PROBES = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclass(frozen=True)
class Site:
    """An allocation site and how much more it holds than before."""

    file: str
    line: int
    size_diff: int  # bytes
    count_diff: int  # allocated blocks
    size: int  # bytes held there now
    stack: tuple[str, ...]  # "file:line" frames, innermost first, as far as recorded

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, object]:
        return {
            "site": self.where, "size_diff": self.size_diff, "count_diff": self.count_diff,
            "size": self.size, "stack": list(self.stack),
        }


class HeapProbe:
    """Traced Python heap bytes, and snapshots to diff; starts tracemalloc if nobody has."""

    def __init__(self, frame_limit: int = DEFAULT_FRAME_LIMIT) -> None:
        # Someone else (pytest -X tracemalloc, the user) may already trace: keep their
        # settings and leave tracing on when we close.
        self._started_here = not tracemalloc.is_tracing()
        if self._started_here:
            tracemalloc.start(frame_limit)

    @property
    def tracing(self) -> bool:
        return tracemalloc.is_tracing()

    def read(self) -> int | None:
        """Bytes the traced Python allocations hold now (None once tracing stopped)."""
        if not tracemalloc.is_tracing():
            return None
        return tracemalloc.get_traced_memory()[0]

    def snapshot(self) -> tracemalloc.Snapshot | None:
        """A filtered snapshot to diff against later (milliseconds; take it sparingly)."""
        if not tracemalloc.is_tracing():
            return None
        return tracemalloc.take_snapshot().filter_traces(_SNAPSHOT_FILTERS)

    def close(self) -> None:
        if self._started_here and tracemalloc.is_tracing():
            tracemalloc.stop()
        self._started_here = False


def _culprit(frames: tracemalloc.Traceback) -> tracemalloc.Frame:
    """Innermost frame outside the standard library and these probes (else the innermost)."""
    for frame in reversed(frames):  # a Traceback runs oldest to most recent
        name = os.path.normcase(frame.filename)
        if not (name.startswith(_STDLIB) or name.startswith(_PROBES)):
            return frame
    return frames[-1]


def top_growth(old: tracemalloc.Snapshot, new: tracemalloc.Snapshot, limit: int = 10) -> list[Site]:
    """Sites whose memory grew most from ``old`` to ``new``, largest growth first."""
    grouped: dict[tuple[str, int], list] = {}
    for diff in new.compare_to(old, "traceback"):
        if diff.size_diff <= 0:
            continue
        frame = _culprit(diff.traceback)
        entry = grouped.setdefault((frame.filename, frame.lineno), [0, 0, 0, diff.traceback])
        entry[0] += diff.size_diff
        entry[1] += diff.count_diff
        entry[2] += diff.size
    ranked = sorted(grouped.items(), key=lambda kv: kv[1][0], reverse=True)[:limit]
    return [
        Site(file=file, line=line, size_diff=size_diff, count_diff=count_diff, size=size,
             stack=tuple(f"{f.filename}:{f.lineno}" for f in reversed(tb)))
        for (file, line), (size_diff, count_diff, size, tb) in ranked
    ]
