"""Root causes first: one finding per cause, its cascade counted as its evidence.

One bug often breaks many things at once. A NaN in one layer's scores turns every later layer of
every sequence non-finite (hundreds of findings, the first layer last in line); a rollback that does not
cut a sequence's length puts every later batch row and write at the wrong position (hundreds); a
stale copy swapped in is then read at every layer. Reporting each one buries the line to fix. So
the suite hands every accepted finding to ``Causes`` first: the first finding of a cause is kept
and stands for it; a later finding of the same cause is folded into the first's
``evidence["cascade"]`` (how many, which rules, sequences, layers, steps) instead of being
reported. What makes one cause is the rule's family and, where it matters, the block or tier:

- ``attention/nonfinite``: one cause per source of NaN; its first finding names the first layer that
  went non-finite. A NaN flows up the layers and on to later steps, never down, and reaches the
  sequences that share its blocks: a later NaN in the same sequence, in one sharing its blocks, or
  first showing at the cause's layer or above is counted under it; one first showing below every
  cause so far is another source, reported on its own;
- ``batch/batch-position`` and ``batch/write-position``: one cause per trace (a sequence whose length
  went wrong once, as after an uncut rollback, is off at every later step);
- ``stale/stale-swap-in``, ``stale/stale-read``, ``stale/stale-swap-out``, ``integrity/swap-mismatch``
  and ``integrity/read-mismatch``: one cause per block and sequence (a wrong copy of the block, then
  every move and read of that copy by the sequence, by version or by content digest; a reused id has
  another owner);
- ``leak/usage-mismatch``: one cause per tier (the disagreement growing step after step).

A finding that only says a count is off without naming a block (``usage-mismatch`` with no
stranded block) is a symptom: reports order it after the findings that name what went wrong.
"""

from __future__ import annotations

from typing import Any, Callable

from ..findings import Finding

__all__ = ["Causes", "cascade_line", "is_symptom"]

_SAMPLES = 16  # sequences named in a cascade's evidence; the rest are counted
_TRACKED = 65536  # sequences a cause remembers, to count each once: past it, a long run's memory stays flat

_FAMILY: dict[str, Callable[[Finding], tuple | None]] = {
    "batch/batch-position": lambda f: ("position",),
    "batch/write-position": lambda f: ("position",),
    "stale/stale-swap-in": lambda f: ("copy", f.block, f.seq),
    "stale/stale-read": lambda f: ("copy", f.block, f.seq),
    "stale/stale-swap-out": lambda f: ("copy", f.block, f.seq),
    "integrity/swap-mismatch": lambda f: ("copy", f.block, f.seq),
    "integrity/read-mismatch": lambda f: ("copy", f.block, f.seq),
    "leak/usage-mismatch": lambda f: ("usage", f.evidence.get("tier")),
}


class Causes:
    """The causes seen so far in one stream of findings, by family key -> the finding that stands for it."""

    def __init__(self, ledger: Any = None) -> None:
        self.ledger = ledger  # who shares which blocks, to follow a NaN from sequence to sequence
        self._roots: dict[tuple, Finding] = {}
        self._seqs: dict[tuple, set] = {}  # the sequences each cause reached, beyond its root's

    def absorb(self, f: Finding) -> bool:
        """True when ``f`` belongs to a cause already reported: it is counted in that finding's cascade."""
        rule = f"{f.check}/{f.rule}"
        if rule == "attention/nonfinite":
            key = self._spread_of(f)
        else:
            family = _FAMILY.get(rule)
            if family is None:
                return False
            key = family(f)
        root = self._roots.get(key)
        if root is None:
            self._roots[key] = f
            self._seqs[key] = {f.seq}
            return False
        self._count(key, root, f)
        return True

    def _spread_of(self, f: Finding) -> tuple:
        """The NaN cause ``f`` belongs to: its sequence's, one whose sequences share a block with its sequence,
        or one that first went non-finite at ``f``'s layer or below (a NaN flows up the layers and on to later
        steps, never down); else, first showing below every cause so far, a cause of its own."""
        below = None
        for key, root in self._roots.items():
            if key[0] != "nonfinite":
                continue
            seqs = self._seqs[key]
            if f.seq in seqs or self._shares(f.seq, seqs):
                return key
            if root.layer is not None and f.layer is not None and root.layer <= f.layer:
                below = below or key
        return below or ("nonfinite", f.layer)

    def _shares(self, seq: Any, seqs: set) -> bool:
        ledger = self.ledger
        state = ledger.seqs.get(seq) if ledger is not None else None
        if state is None:
            return False
        return any(not seqs.isdisjoint(ledger.owners.get(block, ())) for block in state.blocks)

    def _count(self, key: tuple, root: Finding, f: Finding) -> None:
        """Fold ``f`` into ``root``'s cascade (the root's evidence is its own dict, updated in place so a
        consumer already holding the root sees the count grow)."""
        cascade: dict[str, Any] = root.evidence.setdefault("cascade", {
            "count": 0, "rules": {}, "sequences": [], "num_sequences": 0, "layers": None, "steps": None})
        cascade["count"] += 1
        rule = f"{f.check}/{f.rule}"
        cascade["rules"][rule] = cascade["rules"].get(rule, 0) + 1
        seqs = self._seqs[key]
        if f.seq is not None and f.seq not in seqs and len(seqs) < _TRACKED:
            seqs.add(f.seq)
            cascade["num_sequences"] += 1
            if len(cascade["sequences"]) < _SAMPLES:
                cascade["sequences"].append(f.seq)
        for name, value in (("layers", f.layer), ("steps", f.step)):
            if value is not None:
                span = cascade[name]
                cascade[name] = [value, value] if span is None else [min(span[0], value), max(span[1], value)]


def cascade_line(f: Finding) -> str | None:
    """The cascade on one line, as ``and 337 more from the same cause: attention/nonfinite x337,
    22 more sequence(s), layers 15-29, steps 2-146``."""
    cascade = f.evidence.get("cascade")
    if not cascade:
        return None
    parts = [", ".join(f"{rule} x{n}" for rule, n in cascade["rules"].items())]
    if cascade["num_sequences"]:
        parts.append(f"{cascade['num_sequences']} more sequence(s)")
    for name in ("layers", "steps"):
        span = cascade[name]
        if span is not None:
            parts.append(f"{name} {span[0]}-{span[1]}" if span[0] != span[1] else f"{name[:-1]} {span[0]}")
    return f"and {cascade['count']} more from the same cause: {', '.join(parts)}"


def is_symptom(f: Finding) -> bool:
    """A finding that says a count is off without naming a block or sequence: ordered after the rest."""
    return f.rule == "usage-mismatch" and not f.evidence.get("stranded_blocks")
