"""A model's normal attention, learned from clean runs: the ranges the attention check judges against.

What a healthy layer's statistics look like depends on the model, the layer, and how many keys
the query sees (entropy grows with the number of keys), so one threshold cannot fit every layer
and a baseline learned from the run being judged mistakes the run's own novelty (a longer
prompt than any before it) for an anomaly. A profile stores, per layer, the range of ``max_logit``
over clean runs and, per key-count bucket (powers of two: up to 16 keys, 17-32, ...), the range
of entropy. It is written by ``kvdoctor attention-profile TRACE...`` (or ``ProfileBuilder`` over
any events) and read by ``kvdoctor check``; one ships for the embedded SmolLM2.

A profile is plain JSON::

    {"format": "kvdoctor-attention-profile", "version": 1, "model": "SmolLM2-135M-Instruct",
     "num_events": 123456, "layers": {"0": {"n": 4000, "logit": [min, median, max],
                                            "entropy": {"4": [n, min, median, max], ...}}, ...}}
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from ..events import Attn, AttnStep, Batch, SeqEnd

__all__ = ["AttentionProfile", "LayerProfile", "ProfileBuilder", "Span", "bucket_of", "shipped_profile",
           "PROFILE_FORMAT"]

PROFILE_FORMAT = "kvdoctor-attention-profile"
_VERSION = 1
_RESERVOIR = 4096  # values kept per (layer, bucket) for the median; min and max are exact


def bucket_of(num_keys: int) -> int:
    """The key-count bucket: 0 for up to 16 keys, then one per doubling (17-32 is 1, 33-64 is 2 ...)."""
    return max(0, (max(num_keys, 1) - 1).bit_length() - 4)


@dataclass(frozen=True)
class Span:
    """A statistic's observed range in clean runs: how many values, their min, median and max."""

    n: int
    lo: float
    mid: float
    hi: float

    def widened(self, margin: float, min_width: float) -> tuple[float, float]:
        """(lower, upper) bounds: the range grown by ``margin`` times its width on each side."""
        pad = margin * max(self.hi - self.lo, min_width)
        return self.lo - pad, self.hi + pad

    def union(self, other: "Span") -> "Span":
        return Span(self.n + other.n, min(self.lo, other.lo), self.mid if self.n >= other.n else other.mid,
                    max(self.hi, other.hi))


@dataclass(frozen=True)
class LayerProfile:
    logit: Span
    entropy: dict[int, Span]  # key-count bucket -> entropy range

    def entropy_span(self, bucket: int | None) -> Span:
        """The entropy range around ``bucket`` (its neighbours too: statistics change smoothly with
        length and a sparse bucket alone is a thin sample); every bucket when the length is unknown.
        Beyond the longest bucket learned, the upper end grows by log 2 per doubling (the most a
        doubling of keys can add to entropy)."""
        spans = self.entropy
        if bucket is None or all(b < 0 for b in spans):
            chosen = list(spans.values())
        else:
            top = max(b for b in spans if b >= 0)
            if bucket > top:
                s = spans[top]
                return Span(s.n, s.lo, s.mid, s.hi + (bucket - top) * math.log(2))
            chosen = [spans[b] for b in (bucket - 1, bucket, bucket + 1) if b in spans]
            if not chosen:
                chosen = [spans[min(spans, key=lambda b: abs(b - bucket))]]
        out = chosen[0]
        for s in chosen[1:]:
            out = out.union(s)
        return out


@dataclass(frozen=True)
class AttentionProfile:
    model: str | None
    layers: dict[int, LayerProfile]
    num_events: int = 0
    source: str = ""  # where it was loaded from, for messages

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT, "version": _VERSION, "model": self.model, "num_events": self.num_events,
            "layers": {str(li): {"n": lp.logit.n, "logit": [lp.logit.lo, lp.logit.mid, lp.logit.hi],
                                 "entropy": {str(b): [s.n, s.lo, s.mid, s.hi] for b, s in sorted(lp.entropy.items())}}
                       for li, lp in sorted(self.layers.items())},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> "AttentionProfile":
        """Parse and validate; a malformed profile raises ``ValueError`` naming what is wrong."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{source}: not a kvdoctor attention profile (no \"format\": \"{PROFILE_FORMAT}\")")
        if data.get("version") != _VERSION:
            raise ValueError(f"{source}: attention profile version {data.get('version')!r}, this kvdoctor reads {_VERSION}")
        layers: dict[int, LayerProfile] = {}
        try:
            for key, lp in data["layers"].items():
                lo, mid, hi = (float(x) for x in lp["logit"])
                entropy = {}
                for b, (n, elo, emid, ehi) in lp["entropy"].items():
                    entropy[int(b)] = Span(int(n), float(elo), float(emid), float(ehi))
                if not entropy or not lo <= mid <= hi:
                    raise ValueError(f"layer {key}")
                layers[int(key)] = LayerProfile(Span(int(lp["n"]), lo, mid, hi), entropy)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{source}: malformed attention profile ({type(exc).__name__}: {exc})") from None
        if not layers:
            raise ValueError(f"{source}: the attention profile has no layers")
        return cls(data.get("model"), layers, int(data.get("num_events", 0)), source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "AttentionProfile":
        """Read a profile file; ``OSError`` if it cannot be read, ``ValueError`` if it is not one."""
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        return cls.from_dict(data, str(path))


def shipped_profile(model: str | None) -> AttentionProfile | None:
    """The profile kvdoctor ships for ``model`` (a trace header's ``model``), if any."""
    if not model:
        return None
    name = f"{Path(model).name}.json"
    entry = resources.files(__package__).joinpath("profiles", name)
    if not entry.is_file():
        return None
    return AttentionProfile.from_dict(json.loads(entry.read_text(encoding="utf-8")), f"shipped profile {name}")


@dataclass
class _Acc:
    """Exact min and max and a reservoir sample (for the median) of one statistic."""

    n: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    sample: list[float] = field(default_factory=list)

    def add(self, x: float, rng: random.Random) -> None:
        self.n += 1
        self.lo = min(self.lo, x)
        self.hi = max(self.hi, x)
        if len(self.sample) < _RESERVOIR:
            self.sample.append(x)
        else:
            j = rng.randrange(self.n)
            if j < _RESERVOIR:
                self.sample[j] = x

    def span(self) -> Span:
        ordered = sorted(self.sample)
        return Span(self.n, self.lo, ordered[len(ordered) // 2], self.hi)


class ProfileBuilder:
    """Learns an ``AttentionProfile`` from the events of clean runs (any number of traces or buses).

    A sequence's number of keys is its length after the step's ``batch`` (position + tokens), so a
    trace without ``batch`` events still profiles, with every value in the bucket of unknown length
    folded into the layer's whole range. Non-finite statistics are not learned: they are never normal.
    """

    def __init__(self, model: str | None = None, seed: int = 0) -> None:
        self.model = model
        self.num_events = 0
        self._rng = random.Random(seed)
        self._lengths: dict[Any, int] = {}
        self._logit: dict[int, _Acc] = {}
        self._entropy: dict[tuple[int, int], _Acc] = {}

    def feed(self, events: Iterable[Any]) -> None:
        """A batch of events (a ``Bus`` sink, a trace's chunk)."""
        for ev in events:
            self.observe(ev)

    def observe(self, ev: Any) -> None:
        if isinstance(ev, Attn):
            if ev.nonfinite or not math.isfinite(ev.max_logit + ev.entropy + ev.sink):
                return
            self.num_events += 1
            rng = self._rng
            self._logit.setdefault(ev.layer, _Acc()).add(ev.max_logit, rng)
            length = self._lengths.get(ev.seq)
            if length is not None:
                self._entropy.setdefault((ev.layer, bucket_of(length)), _Acc()).add(ev.entropy, rng)
        elif isinstance(ev, AttnStep):
            for row in ev.rows():
                self.observe(row)
        elif isinstance(ev, Batch):
            for seq, pos, n in zip(ev.rows, ev.positions, ev.n):
                self._lengths[seq] = pos + n
        elif isinstance(ev, SeqEnd):
            self._lengths.pop(ev.seq, None)

    def profile(self) -> AttentionProfile:
        if not self._logit:
            raise ValueError("no finite attn events with known lengths to learn an attention profile from")
        layers = {}
        for li, acc in sorted(self._logit.items()):
            entropy = {b: a.span() for (l2, b), a in sorted(self._entropy.items()) if l2 == li}
            if entropy:
                layers[li] = LayerProfile(acc.span(), entropy)
        if not layers:
            raise ValueError("no attn events with known lengths (batch events) to learn entropy ranges from")
        return AttentionProfile(self.model, layers, self.num_events)
