"""Attention anomalies: what a K/V bug does to attention, not whatever is merely rare.

A healthy model's attention statistics depend on the layer, the prompt, the token and how many
keys the query sees; a rule that flags the rare will flag healthy runs (the first version of this
check did, on every demo). So each rule here targets what a bug does:

- ``nonfinite``: NaN or infinity in a score or probability. Nothing legitimate produces one.
- ``max-logit-outlier``: scores above the range this layer ever produces. Garbage or mis-scaled
  keys (a wrong dequantisation scale, uninitialised memory, a flipped exponent bit) push the
  largest score far above a range that healthy runs keep narrow. (Keys read as zeros pull it
  down, but so does a prompt of repeated ``<|endoftext|>``, whose keys are near zero: a low
  score is no evidence, and the low side is not judged.)
- ``entropy-outlier``: more entropy than the query's keys can hold (``log keys``): it attended to
  keys its sequence does not have (a mask, length or block-table bug). Uniform attention over
  the right keys is no evidence either: repeated tokens make it.
- ``entropy-collapse``: every head on one key, in a layer that never does that at this length.
- ``sink-shift``: the mass on the first block jumps in most layers at once and stays. A healthy
  sequence's sink mass drifts layer by layer as it grows; a first block swapped for another's,
  or keys at the wrong positions, move it in every layer at the same step.

The normal ranges (max_logit per layer; entropy per layer and key count, whose floor the collapse
rule reads) come from an ``AttentionProfile`` learned from clean runs of the model (one ships for
the embedded SmolLM2; ``kvdoctor attention-profile`` builds one for another). Without
a profile the check learns the ranges from the trace itself, per layer and key-count bucket,
and judges a bucket only after ``warmup`` observations, with a wider ``self_margin``. An anomaly
must last ``persist`` consecutive observations of the same (sequence, layer) before it is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..events import Attn, AttnStep, Batch, SeqEnd
from ..findings import Finding

from .attention_profile import AttentionProfile, LayerProfile, Span, bucket_of
from .base import NO_FINDINGS, CheckBase, Rule
from .ledger import Ledger

__all__ = ["AttentionCheck", "AttentionSettings"]

_INF = math.inf
_UNKNOWN = -16  # the bucket a learned value of unknown length is kept in (never a neighbour of a real one)
_ENTROPY_SLACK = 0.01  # nats above log(keys) that float32 rounding may add


@dataclass(frozen=True)
class AttentionSettings:
    """Thresholds of the attention check (``[tool.kvdoctor.attention]``)."""

    persist: int = 2  # consecutive observations of one (sequence, layer) an anomaly must last
    margin: float = 0.5  # a profile's max_logit range is widened by this times its width
    self_margin: float = 1.0  # ... and a range learned from the trace itself (no profile) by this
    warmup: int = 64  # without a profile: observations of a layer (and length bucket) before it is judged
    min_width_logit: float = 2.0  # the narrowest range of max_logit a margin is taken of
    collapse_entropy: float = 0.02  # mean entropy (nats) counted as every head on one key
    collapse_floor: float = 0.2  # ... only where the layer's normal minimum at that length is above this
    sink_drop: float = 0.25  # sink mass below this share of its running level (or above its inverse) ...
    sink_layers: float = 0.75  # ... in at least this share of the layers at one step is a shift
    sink_min_delta: float = 0.05  # ... and a layer counts only when its mass moved by this much
    min_keys: int = 64  # collapse and sink rules judge queries that see at least this many keys

    def __post_init__(self) -> None:
        for f in fields(self):
            value, zero_ok = getattr(self, f.name), f.name in ("warmup", "margin", "self_margin")
            if value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"attention.{f.name} must be {'>= 0' if zero_ok else '> 0'}, got {value}")
        for name in ("sink_drop", "sink_layers"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"attention.{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class _Bounds:
    """What one (layer, key-count bucket) allows, and what the bounds came from."""

    logit_hi: float
    ent_floor: float  # the lowest entropy the layer shows at this length in clean runs
    can_collapse: bool  # that floor is above collapse_floor: a collapse here is no healthy behaviour
    logit: Span
    entropy: Span
    # the ranges outside which a value is learned, read on every statistic: the spans' ends, looked up once
    logit_lo: float = field(init=False)
    logit_top: float = field(init=False)
    ent_lo: float = field(init=False)
    ent_hi: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_lo", self.logit.lo)
        object.__setattr__(self, "logit_top", self.logit.hi)
        object.__setattr__(self, "ent_lo", self.entropy.lo)
        object.__setattr__(self, "ent_hi", self.entropy.hi)


class _Learned:
    """Without a profile: the trace's own ranges, per layer (max_logit) and per (layer, bucket) (entropy).
    Only values judged normal are learned, so a persisting anomaly cannot widen the range it breaks."""

    def __init__(self) -> None:
        self.logit: dict[int, list[float]] = {}  # layer -> [n, lo, hi]
        self.entropy: dict[int, dict[int, list[float]]] = {}  # layer -> bucket -> [n, lo, hi]

    @staticmethod
    def _add(table: dict, key: int, x: float) -> bool:
        """Learn ``x``; True when that changed the range (cached bounds of the layer are then stale)."""
        acc = table.get(key)
        if acc is None:
            table[key] = [1, x, x]
            return True
        acc[0] += 1
        if x < acc[1]:
            acc[1] = x
        elif x > acc[2]:
            acc[2] = x
        else:
            return False
        return True

    def learn(self, layer: int, bucket: int, logit: float, entropy: float) -> bool:
        changed = self._add(self.logit, layer, logit)
        return self._add(self.entropy.setdefault(layer, {}), bucket, entropy) or changed

    def profile(self, layer: int) -> AttentionProfile | None:
        acc = self.logit.get(layer)
        if acc is None:
            return None
        entropy = {b: _span(a) for b, a in self.entropy[layer].items()}
        return AttentionProfile(None, {layer: LayerProfile(_span(acc), entropy)})


def _span(acc: list[float]) -> Span:
    return Span(int(acc[0]), acc[1], 0.5 * (acc[1] + acc[2]), acc[2])


class _SeqSinks:
    """One sequence's sink mass per layer: the running level, this step's values, the shift streak."""

    __slots__ = ("level", "now", "keys", "streak")

    def __init__(self) -> None:
        self.level: dict[int, float] = {}
        self.now: dict[int, float] = {}
        self.keys = 0
        self.streak = 0


class AttentionCheck(CheckBase):
    name = "attention"
    RULES = (
        Rule("nonfinite", "error", "non-finite attention scores or probabilities"),
        Rule("max-logit-outlier", "warning", "max logit above the range the layer shows in clean runs, persisting"),
        Rule("entropy-outlier", "warning", "more entropy than the query's keys can hold (attended to keys not its own), persisting"),
        Rule("entropy-collapse", "warning", "every head on one key where the layer never collapses at this length, persisting"),
        Rule("sink-shift", "warning", "mass on the first block jumped in most layers at once and stayed"),
    )

    def __init__(self, settings: AttentionSettings | None = None, ledger: Ledger | None = None,
                 profile: AttentionProfile | None = None) -> None:
        super().__init__(ledger)
        self.settings = settings or AttentionSettings()
        self.profile: AttentionProfile | None = None
        self._learned = _Learned()
        self._bounds: dict[int, dict[int, _Bounds]] = {}  # bucket -> layer -> bounds; a learned change drops the layer's
        # seq -> what its newest query's key count (from the step's batch) settles for every layer: the count,
        # its bucket, the most entropy it can hold (None: log undefined), whether the collapse and sink rules judge it
        self._keys: dict[Any, tuple[int, int, float | None, bool]] = {}
        # seq -> its sink values of this step, once its first statistic since the step (or its batch) began set
        # up its sink state: the other layers only add their value
        self._open: dict[Any, dict[int, float]] = {}
        self._streaks: dict[tuple[Any, int], list[int]] = {}  # (seq, layer) -> [logit, entropy, collapse]
        self._sinks: dict[Any, _SeqSinks] = {}
        self._touched: set = set()  # sequences with sink values this step
        self._min_keys = self.settings.min_keys  # read on every event
        self._collapse_entropy = self.settings.collapse_entropy
        self.use_profile(profile)

    def use_profile(self, profile: AttentionProfile | None) -> None:
        """Judge against ``profile`` from now on (None: ranges learned from the trace itself)."""
        self.profile = profile
        self._bounds.clear()

    def handlers(self):
        return {Attn: self._attn, AttnStep: self._attn_step, Batch: self._batch, SeqEnd: self._seq_end}

    # ---- state ------------------------------------------------------------------------------

    def _batch(self, ev: Batch) -> Sequence[Finding]:
        min_keys = self._min_keys
        for seq, pos, n in zip(ev.rows, ev.positions, ev.n):
            keys = pos + n
            self._keys[seq] = (keys, bucket_of(keys), math.log(keys) + _ENTROPY_SLACK if keys > 0 else None,
                               keys >= min_keys)
        if self._open:
            self._open.clear()  # a new key count may restart a sequence's sink levels
        return NO_FINDINGS

    def _seq_end(self, ev: SeqEnd) -> Sequence[Finding]:
        self._keys.pop(ev.seq, None)
        self._open.pop(ev.seq, None)
        self._sinks.pop(ev.seq, None)
        for key in [k for k in self._streaks if k[0] == ev.seq]:
            del self._streaks[key]
        return NO_FINDINGS

    def _bounds_for(self, layer: int, bucket: int) -> _Bounds | None:
        """The allowed ranges at (layer, bucket), from the profile or what this trace taught so far; cached."""
        s = self.settings
        if self.profile is not None:
            prof, margin = self.profile, s.margin
        else:
            prof, margin = self._learned.profile(layer), s.self_margin
        lp = prof.layers.get(layer) if prof is not None else None
        if lp is None:
            return None
        ent = lp.entropy_span(None if bucket == _UNKNOWN else bucket)
        if self.profile is None and (lp.logit.n < s.warmup or ent.n < s.warmup):
            return None
        b = _Bounds(lp.logit.widened(margin, s.min_width_logit)[1], ent.lo,
                    ent.lo > s.collapse_floor, lp.logit, ent)
        self._bounds.setdefault(bucket, {})[layer] = b
        return b

    # ---- judging ------------------------------------------------------------------------------

    def _attn_step(self, ev: AttnStep) -> Sequence[Finding]:
        """Every row and layer of the step, as the ``attn`` events it stands for."""
        found: list[Finding] = []
        for row in ev.rows():
            found.extend(self._attn(row))
        return found or NO_FINDINGS

    def _attn(self, ev: Attn) -> Sequence[Finding]:
        logit, ent, sink = ev.max_logit, ev.entropy, ev.sink
        total = logit + ent + sink
        if ev.nonfinite or total - total:  # x - x is 0.0 for a finite x, NaN otherwise
            return self._nonfinite(ev)
        seq, layer = ev.seq, ev.layer
        known = self._keys.get(seq)
        if known is None:
            keys, bucket, high_ent, judged_keys = None, _UNKNOWN, False, True
        else:
            keys, bucket, most, judged_keys = known
            # More entropy than the keys can hold: the query attended to keys its sequence does not have.
            high_ent = ent > (most if most is not None else math.log(keys) + _ENTROPY_SLACK)
        if judged_keys:  # the step's sink mass of this layer, judged across layers at the step's end
            now = self._open.get(seq)
            if now is None:
                now = self._open[seq] = self._sink_state(seq, keys).now
            now[layer] = sink
        by_layer = self._bounds.get(bucket)
        bounds = by_layer.get(layer) if by_layer is not None else None
        if bounds is None:
            bounds = self._bounds_for(layer, bucket)
        if bounds is None:
            high_logit = collapsed = False
            if self.profile is None and not high_ent:
                self._learn(layer, bucket, logit, ent)
        else:
            high_logit = logit > bounds.logit_hi
            collapsed = ent < self._collapse_entropy and judged_keys and bounds.can_collapse
        if not (high_logit or high_ent or collapsed):
            if self._streaks:
                self._streaks.pop((seq, layer), None)
            if self.profile is None and bounds is not None and not (
                    bounds.logit_lo <= logit <= bounds.logit_top and bounds.ent_lo <= ent <= bounds.ent_hi):
                self._learn(layer, bucket, logit, ent)  # a value that widens the range it was judged within
            return NO_FINDINGS
        return self._abnormal(ev, keys, bounds, high_logit, high_ent, collapsed)

    def _sink_state(self, seq: Any, keys: int | None) -> _SeqSinks:
        """``seq``'s sink state at its first statistic since the step or its batch began; a sequence rolled back
        or recomputed from the start (fewer keys than before) restarts its levels."""
        st = self._sinks.get(seq)
        if st is None:
            st = self._sinks[seq] = _SeqSinks()
        if keys is not None:
            if keys < st.keys:
                st.level.clear()
                st.streak = 0
            st.keys = keys
        self._touched.add(seq)
        return st

    def _abnormal(self, ev: Attn, keys: int | None, bounds: _Bounds | None, high_logit: bool, high_ent: bool,
                  collapsed: bool) -> Sequence[Finding]:
        """Count the streaks of what is out of range; report a rule when its streak reaches ``persist``."""
        streak = self._streaks.setdefault((ev.seq, ev.layer), [0, 0, 0])
        persist = self.settings.persist
        out: Sequence[Finding] = NO_FINDINGS
        streak[0] = streak[0] + 1 if high_logit else 0
        if streak[0] == persist and bounds is not None:
            out = self._logit(ev, bounds, keys, out)
        streak[1] = streak[1] + 1 if high_ent else 0
        if streak[1] == persist and keys is not None:
            out = self._entropy(ev, keys, out)
        streak[2] = streak[2] + 1 if collapsed else 0
        if streak[2] == persist and bounds is not None:
            out = self._collapse(ev, bounds, keys, out)
        return out

    def _learn(self, layer: int, bucket: int, logit: float, ent: float) -> None:
        if self._learned.learn(layer, bucket, logit, ent):
            for by_layer in self._bounds.values():
                by_layer.pop(layer, None)

    def end_step(self, step: int) -> Sequence[Finding]:
        """Sink shifts are judged once a step's statistics of every layer are in."""
        if not self._touched:
            return NO_FINDINGS
        out: Sequence[Finding] = NO_FINDINGS
        s = self.settings
        min_delta, drop, share = s.sink_min_delta, s.sink_drop, s.sink_layers
        for seq in self._touched:
            st = self._sinks.get(seq)
            if st is None:
                continue
            now, level = st.now, st.level
            common = moved = 0  # layers with a level, and those whose mass moved from it
            for li, new in now.items():
                old = level.get(li)
                if old is not None:
                    common += 1
                    if abs(new - old) >= min_delta and (new < drop * old or new * drop > old):
                        moved += 1
            if common and common == len(now) and moved >= share * common:
                st.streak += 1
                if st.streak == s.persist:
                    out = self._sink_shift(seq, step, level, now, moved, out)
                    level.update(now)  # the new level is the reference from here on
                    st.streak = 0
            else:
                st.streak = 0
                for li, new in now.items():
                    old = level.get(li)
                    level[li] = new if old is None else old + 0.25 * (new - old)
            st.now = {}
        self._touched = set()
        self._open.clear()
        return out

    # ---- findings -----------------------------------------------------------------------------

    def _nonfinite(self, ev: Attn) -> Sequence[Finding]:
        if not self.once("nonfinite", ev.seq, ev.layer):
            return NO_FINDINGS
        count = ev.nonfinite or 1
        return [self.finding(
            "nonfinite",
            f"layer {ev.layer} of sequence {ev.seq!r}: {count} non-finite attention values "
            f"(max_logit={ev.max_logit:.4g}, entropy={ev.entropy:.4g}, sink={ev.sink:.3g})",
            seq=ev.seq, layer=ev.layer, step=ev.step, nonfinite=count,
            events=[_attn_dict(ev)],
        )]

    def _once(self, ev: Attn, rule: str, message: str, out, **evidence):
        """Append ``rule``'s finding for this sequence and layer, the first time it holds."""
        if not self.once(rule, ev.seq, ev.layer):
            return out
        return [*out, self.finding(rule, f"layer {ev.layer} of sequence {ev.seq!r}: {message}",
                                   seq=ev.seq, layer=ev.layer, step=ev.step, events=[_attn_dict(ev)], **evidence)]

    def _against(self) -> str:
        p = self.profile
        if p is None:
            return "this trace's own range so far"
        return f"the attention profile{f' of {p.model}' if p.model else ''}"

    def _logit(self, ev: Attn, bounds: _Bounds, keys: int | None, out):
        span = bounds.logit
        return self._once(
            ev, "max-logit-outlier",
            f"max logit {ev.max_logit:.4g} is above {bounds.logit_hi:.4g} ({self._against()}: {span.lo:.4g} .. "
            f"{span.hi:.4g}, widened), for {self.settings.persist} observations in a row",
            out, value=ev.max_logit, allowed_max=bounds.logit_hi, normal=[span.lo, span.hi], keys=keys,
            profile=self.profile.model if self.profile else None,
        )

    def _entropy(self, ev: Attn, keys: int, out):
        most = math.log(keys)
        return self._once(
            ev, "entropy-outlier",
            f"entropy {ev.entropy:.4g} nats is above log({keys}) = {most:.4g}, the most {keys} keys can give: "
            f"the query attended to keys its sequence does not have, for {self.settings.persist} observations in a row",
            out, value=ev.entropy, max_entropy=most, keys=keys,
        )

    def _collapse(self, ev: Attn, bounds: _Bounds, keys: int | None, out):
        at = f" at {keys} keys" if keys is not None else ""
        return self._once(
            ev, "entropy-collapse",
            f"attention entropy {ev.entropy:.3g} nats{at} for {self.settings.persist} observations: every head on "
            f"one key, where the layer's lowest in {self._against()} is {bounds.ent_floor:.3g}",
            out, value=ev.entropy, floor=bounds.ent_floor, keys=keys,
        )

    def _sink_shift(self, seq: Any, step: int, level: dict[int, float], now: dict[int, float], moved: int, out):
        if not self.once("sink-shift", seq):
            return out
        layers = sorted(now)
        before = sorted(level[li] for li in layers)[len(layers) // 2]
        after = sorted(now.values())[len(layers) // 2]
        return [*out, self.finding(
            "sink-shift",
            f"sequence {seq!r}: mass on the first block moved in {moved} of {len(layers)} layers at once "
            f"(median {before:.3f} -> {after:.3f}) and stayed for {self.settings.persist} steps",
            seq=seq, step=step, layers_moved=moved, num_layers=len(layers),
            level={li: round(level[li], 4) for li in layers}, sink={li: round(now[li], 4) for li in layers},
        )]


def _attn_dict(ev: Attn) -> dict:
    """The event as a dict that survives JSON even when it holds NaN or infinity."""
    d = {"kind": "attn", "t": ev.t, "step": ev.step, "seq": ev.seq, "layer": ev.layer,
         "nonfinite": ev.nonfinite}
    for name in ("max_logit", "entropy", "sink"):
        value = getattr(ev, name)
        d[name] = value if -_INF < value < _INF else repr(value)
    return d
