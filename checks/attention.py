"""Attention anomalies: non-finite scores, and statistics far outside a layer's usual range.

A corrupted or misplaced K/V block rarely crashes anything; it shows up as attention that
behaves unlike itself — a max logit or entropy far from what that layer usually produces,
entropy collapsing to one key, the mass on the first (sink) block jumping. Each layer
keeps a robust running baseline (median and MAD over a window of recent values, refreshed
every few observations, so an outlier cannot drag it) and judges nothing before a
warm-up. A value must stay anomalous for ``persist`` consecutive steps of the same
sequence before it is reported, so one odd token is not a finding. Non-finite values are
always errors: nothing legitimate produces them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Sequence

from ..events import Attn, SeqEnd
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule
from .ledger import Ledger

__all__ = ["AttentionCheck", "AttentionSettings"]

_INF = math.inf
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_FULL_SINK = 0.999  # while the first block holds every token, all mass is on it by definition


@dataclass(frozen=True)
class AttentionSettings:
    """Thresholds of the attention check (``[tool.kvdoctor.attention]``)."""

    warmup: int = 64  # observations of a layer before its baseline judges anything
    window: int = 256  # recent observations per layer that form the baseline
    refresh: int = 128  # recompute median and MAD every this many observations
    z_threshold: float = 10.0  # robust z-score beyond which max_logit or entropy is an outlier
    persist: int = 3  # consecutive steps of one sequence that an anomaly must last
    min_scale_logit: float = 0.5  # floor of the robust sigma of max_logit (a flat layer)
    min_scale_entropy: float = 0.05  # floor of the robust sigma of entropy, nats
    seq_warmup: int = 4  # observations of a (sequence, layer) before collapse and sink rules judge it
    collapse_entropy: float = 0.02  # mean entropy (nats) counted as collapsed onto one key
    collapse_baseline: float = 0.5  # ...only in a layer whose median entropy is above this
    sink_shift: float = 0.5  # jump of sink mass from its running level counted as a shift

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value <= 0 and f.name not in ("warmup", "seq_warmup"):
                raise ValueError(f"attention.{f.name} must be > 0, got {value}")
            if value < 0:
                raise ValueError(f"attention.{f.name} must be >= 0, got {value}")
        if self.refresh > self.window:
            raise ValueError(f"attention.refresh must be <= attention.window ({self.window}), got {self.refresh}")
        if not 0 < self.sink_shift <= 1:
            raise ValueError(f"attention.sink_shift must be in (0, 1], got {self.sink_shift}")


class _Layer:
    """One layer's baseline and the per-sequence streaks judged against it.

    The baseline is kept as bounds (median -/+ z * robust sigma) so that judging a value is
    one chained comparison; they are recomputed every ``refresh`` observations.
    """

    __slots__ = ("count", "next_refresh", "logits", "entropies", "logit_med", "logit_scale", "ent_med",
                 "ent_scale", "logit_lo", "logit_hi", "ent_lo", "ent_hi", "can_collapse", "seqs")

    def __init__(self, s: AttentionSettings) -> None:
        self.count = 0
        self.next_refresh = min(s.refresh, s.warmup) or s.refresh
        self.logits: deque[float] = deque(maxlen=s.window)
        self.entropies: deque[float] = deque(maxlen=s.window)
        self.logit_med = self.logit_scale = self.ent_med = self.ent_scale = 0.0
        self.logit_lo = self.ent_lo = -_INF
        self.logit_hi = self.ent_hi = _INF
        self.can_collapse = False
        # seq -> [observations, logit streak, entropy streak, collapse streak, sink level, sink streak]
        self.seqs: dict = {}

    def refresh(self, s: AttentionSettings) -> None:
        self.next_refresh = self.count + s.refresh
        z = s.z_threshold
        self.logit_med, mad = _median_mad(self.logits)
        self.logit_scale = max(_MAD_TO_SIGMA * mad, s.min_scale_logit)
        self.logit_lo, self.logit_hi = self.logit_med - z * self.logit_scale, self.logit_med + z * self.logit_scale
        self.ent_med, mad = _median_mad(self.entropies)
        self.ent_scale = max(_MAD_TO_SIGMA * mad, s.min_scale_entropy)
        self.ent_lo, self.ent_hi = self.ent_med - z * self.ent_scale, self.ent_med + z * self.ent_scale
        self.can_collapse = self.ent_med > s.collapse_baseline


class AttentionCheck(CheckBase):
    name = "attention"
    RULES = (
        Rule("nonfinite", "error", "non-finite attention scores or probabilities"),
        Rule("max-logit-outlier", "warning", "max logit far outside the layer's running distribution, persisting"),
        Rule("entropy-outlier", "warning", "entropy far outside the layer's running distribution, persisting"),
        Rule("entropy-collapse", "warning", "attention entropy collapsed to near zero, persisting"),
        Rule("sink-shift", "warning", "mass on the first block jumped from its running level, persisting"),
    )

    def __init__(self, settings: AttentionSettings | None = None, ledger: Ledger | None = None) -> None:
        super().__init__(ledger)
        self.settings = s = settings or AttentionSettings()
        self._layers: dict[int, _Layer] = {}
        # settings read on every event, as plain attributes
        self._warmup, self._seq_warmup, self._persist = s.warmup, s.seq_warmup, s.persist
        self._collapse_entropy, self._sink_shift = s.collapse_entropy, s.sink_shift

    def handlers(self):
        return {Attn: self._attn, SeqEnd: self._seq_end}

    def _seq_end(self, ev: SeqEnd) -> Sequence[Finding]:
        for layer in self._layers.values():
            layer.seqs.pop(ev.seq, None)
        return NO_FINDINGS

    def _attn(self, ev: Attn) -> Sequence[Finding]:
        logit, ent, sink = ev.max_logit, ev.entropy, ev.sink
        total = logit + ent + sink
        if ev.nonfinite or total - total:  # x - x is 0.0 for a finite x, NaN otherwise
            return self._nonfinite(ev)
        layer = self._layers.get(ev.layer)
        if layer is None:
            layer = self._layers[ev.layer] = _Layer(self.settings)
        layer.logits.append(logit)
        layer.entropies.append(ent)
        count = layer.count = layer.count + 1
        if count >= layer.next_refresh:
            layer.refresh(self.settings)
        st = layer.seqs.get(ev.seq)
        if st is None:
            st = layer.seqs[ev.seq] = [0, 0, 0, 0, None, 0]
        seen = st[0] = st[0] + 1
        if count <= self._warmup:
            return NO_FINDINGS
        out: list[Finding] | tuple = NO_FINDINGS
        persist = self._persist
        # max_logit outlier
        if not layer.logit_lo <= logit <= layer.logit_hi:
            st[1] += 1
            if st[1] == persist:
                out = self._outlier(ev, "max-logit-outlier", "max logit", logit, layer.logit_med,
                                    layer.logit_scale, out)
        elif st[1]:
            st[1] = 0
        # entropy outlier (a collapse onto one key is the collapse rule's, judged below)
        collapsed = layer.can_collapse and ent < self._collapse_entropy
        if not collapsed and not layer.ent_lo <= ent <= layer.ent_hi:
            st[2] += 1
            if st[2] == persist:
                out = self._outlier(ev, "entropy-outlier", "entropy", ent, layer.ent_med, layer.ent_scale, out)
        elif st[2]:
            st[2] = 0
        if seen <= self._seq_warmup:
            st[4] = sink if sink < _FULL_SINK else None
            return out
        # entropy collapse: near zero where this layer normally spreads its attention
        if collapsed:
            st[3] += 1
            if st[3] == persist:
                out = self._collapse(ev, layer, out)
        elif st[3]:
            st[3] = 0
        # sink shift, judged against the sequence's own running level once its first block
        # no longer holds every token
        level = st[4]
        if level is None:
            if sink < _FULL_SINK:
                st[4] = sink
        elif not -self._sink_shift <= sink - level <= self._sink_shift:
            st[5] += 1
            if st[5] == persist:
                out = self._sink_shift_finding(ev, level, out)
                st[4], st[5] = sink, 0  # the new level is the reference from here on
        else:
            st[5] = 0
            st[4] = level + 0.25 * (sink - level)
        return out

    def _nonfinite(self, ev: Attn) -> Sequence[Finding]:
        if not self.once("nonfinite", ev.seq, ev.layer):
            return NO_FINDINGS
        count = ev.nonfinite or 1
        return [self.finding(
            "nonfinite",
            f"layer {ev.layer} of sequence {ev.seq!r}: {count} non-finite attention values "
            f"(max_logit={ev.max_logit}, entropy={ev.entropy}, sink={ev.sink})",
            seq=ev.seq, layer=ev.layer, step=ev.step, nonfinite=count,
            events=[_attn_dict(ev)],
        )]

    def _once(self, ev: Attn, rule: str, message: str, out, **evidence):
        """Append ``rule``'s finding for this sequence and layer, the first time it holds."""
        if not self.once(rule, ev.seq, ev.layer):
            return out
        return [*out, self.finding(rule, f"layer {ev.layer} of sequence {ev.seq!r}: {message}",
                                   seq=ev.seq, layer=ev.layer, step=ev.step, events=[_attn_dict(ev)], **evidence)]

    def _outlier(self, ev: Attn, rule: str, what: str, value: float, median: float, scale: float, out):
        z = (value - median) / scale
        return self._once(
            ev, rule,
            f"{what} {value:.4g} is {z:+.1f} robust sigmas from the layer's median {median:.4g}, "
            f"for {self.settings.persist} steps in a row",
            out, value=value, median=median, robust_sigma=scale, z=z,
        )

    def _collapse(self, ev: Attn, layer: _Layer, out):
        return self._once(
            ev, "entropy-collapse",
            f"attention entropy {ev.entropy:.3g} nats for {self.settings.persist} steps, "
            f"where the layer's median is {layer.ent_med:.3g}",
            out, value=ev.entropy, median=layer.ent_med,
        )

    def _sink_shift_finding(self, ev: Attn, level: float, out):
        return self._once(
            ev, "sink-shift",
            f"mass on the first block moved from {level:.3f} to {ev.sink:.3f} "
            f"and stayed there for {self.settings.persist} steps",
            out, value=ev.sink, level=level,
        )


def _median_mad(values) -> tuple[float, float]:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    median = ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    dev = sorted([median - v if v < median else v - median for v in ordered])
    mad = dev[mid] if n % 2 else 0.5 * (dev[mid - 1] + dev[mid])
    return median, mad


def _attn_dict(ev: Attn) -> dict:
    """The event as a dict that survives JSON even when it holds NaN or infinity."""
    d = {"kind": "attn", "t": ev.t, "step": ev.step, "seq": ev.seq, "layer": ev.layer,
         "nonfinite": ev.nonfinite}
    for name in ("max_logit", "entropy", "sink"):
        value = getattr(ev, name)
        d[name] = value if -_INF < value < _INF else repr(value)
    return d
