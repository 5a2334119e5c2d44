"""Batch misalignment: a row's K/V landing in, or read from, another sequence's blocks.

Continuous batching packs many sequences into one tensor; one off-by-one in the row to
sequence map, the positions or the slot mapping, and a sequence silently attends to a
neighbour's tokens. The events make the map checkable: each ``write``/``read`` names the
sequence and the blocks, each ``batch`` names the rows and where they start, and the
ledger knows who owns what and how long each sequence is.
"""

from __future__ import annotations

from typing import Sequence

from ..events import Batch, Read, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["BatchCheck"]


class BatchCheck(CheckBase):
    name = "batch"
    RULES = (
        Rule("write-not-owned", "error", "a sequence wrote into a block it does not own"),
        Rule("read-not-owned", "error", "a sequence read a block it does not own"),
        Rule("write-position", "error", "a write does not start where its sequence's cached tokens end"),
        Rule("batch-position", "error", "a batch row does not start at its sequence's current length"),
        Rule("batch-lengths", "error", "a batch's rows, positions and n lists differ in length"),
        Rule("batch-duplicate-row", "error", "a batch lists one sequence in two rows"),
        Rule("batch-shape", "error", "a batch's K shape disagrees with its rows"),
        Rule("batch-ended-row", "error", "a batch computes a sequence that already ended"),
    )

    def handlers(self):
        return {Write: self._write, Read: self._read, Batch: self._batch}

    def _write(self, ev: Write) -> Sequence[Finding]:
        ledger = self.ledger
        owners = ledger.owners.get(ev.block)
        out: list[Finding] = []
        if (owners is None or ev.seq not in owners) and self.once("write-not-owned", ev.seq, ev.block):
            whose = "no sequence (it is not allocated)" if owners is None else _names(owners)
            out.append(self.finding(
                "write-not-owned",
                f"sequence {ev.seq!r} wrote tokens {ev.pos}..{ev.pos + ev.n - 1} into block {ev.block}, "
                f"which belongs to {whose}",
                seq=ev.seq, block=ev.block, step=ev.step, owners=_sorted(owners or ()),
                events=[self.event_dict(ev)], history=ledger.block_history(ev.block),
            ))
        state = ledger.seqs.get(ev.seq)
        if (state is not None and state.length is not None and ev.pos != state.length
                and self.once("write-position", ev.seq)):
            out.append(self.finding(
                "write-position",
                f"sequence {ev.seq!r} holds {state.length} cached tokens but wrote at position {ev.pos} "
                f"of block {ev.block}",
                seq=ev.seq, block=ev.block, step=ev.step, expected_pos=state.length,
                events=[self.event_dict(ev)], history=ledger.block_history(ev.block),
            ))
        return out or NO_FINDINGS

    def _read(self, ev: Read) -> Sequence[Finding]:
        state = self.ledger.seqs.get(ev.seq)
        if state is not None and state.blocks.issuperset(ev.blocks):
            return NO_FINDINGS
        out = []
        all_owners = self.ledger.owners
        for block in ev.blocks:
            owners = all_owners.get(block)
            # Unallocated blocks are the stale check's "read-freed".
            if owners is None or ev.seq in owners or not self.once("read-not-owned", ev.seq, block):
                continue
            out.append(self.finding(
                "read-not-owned",
                f"sequence {ev.seq!r} read block {block}, which belongs to {_names(owners)}",
                seq=ev.seq, block=block, layer=ev.layer, step=ev.step, owners=_sorted(owners),
                events=[self.event_dict(ev)], history=self.ledger.block_history(block),
            ))
        return out

    def _batch(self, ev: Batch) -> Sequence[Finding]:
        rows, positions, n = ev.rows, ev.positions, ev.n
        out = []
        if not len(rows) == len(positions) == len(n):
            if self.once("batch-lengths", ev.step):
                out.append(self.finding(
                    "batch-lengths",
                    f"batch has {len(rows)} rows, {len(positions)} positions and {len(n)} token counts",
                    step=ev.step, events=[self.event_dict(ev)],
                ))
            return out
        if len(set(rows)) != len(rows):
            seen: set = set()
            for row in rows:
                if row in seen and self.once("batch-duplicate-row", ev.step, row):
                    out.append(self.finding(
                        "batch-duplicate-row", f"batch lists sequence {row!r} in more than one row",
                        seq=row, step=ev.step, events=[self.event_dict(ev)],
                    ))
                seen.add(row)
        if ev.shape is not None and not _shape_fits(ev.shape, len(rows), n):
            if self.once("batch-shape", ev.step):
                out.append(self.finding(
                    "batch-shape",
                    f"batch K shape {list(ev.shape)} fits neither {len(rows)} rows of up to {max(n, default=0)} "
                    f"tokens nor {sum(n)} packed tokens",
                    step=ev.step, events=[self.event_dict(ev)],
                ))
        seqs, ended = self.ledger.seqs, self.ledger.ended
        for i, row in enumerate(rows):
            state = seqs.get(row)
            if state is None:
                if row in ended and self.once("batch-ended-row", row):
                    out.append(self.finding(
                        "batch-ended-row",
                        f"batch row {i} computes sequence {row!r}, which ended at step {ended[row]}",
                        seq=row, step=ev.step, row=i, events=[self.event_dict(ev)],
                    ))
                continue
            if state.length is not None and positions[i] != state.length and self.once(
                    "batch-position", ev.step, row):
                out.append(self.finding(
                    "batch-position",
                    f"batch row {i} computes sequence {row!r} from position {positions[i]}, but it holds "
                    f"{state.length} cached tokens",
                    seq=row, step=ev.step, row=i, position=positions[i], expected=state.length,
                    events=[self.event_dict(ev)],
                ))
        return out


def _shape_fits(shape: list[int], num_rows: int, n: list[int]) -> bool:
    """Padded: rows first and a later dim that holds the longest row, e.g. (B, H, T, D).
    Packed: all tokens first, (N, H, D), or behind a batch dim of one, (1, H, N, D)."""
    if not shape:
        return False
    total = sum(n)
    if shape[0] == total or (shape[0] == 1 and total in shape[1:]):
        return True
    return shape[0] == num_rows and max(shape[1:], default=0) >= max(n, default=0)


def _sorted(owners) -> list:
    return sorted(owners, key=str)


def _names(owners) -> str:
    names = _sorted(owners)
    if not names:
        return "no sequence (its owners all let go)"
    return ("sequence " if len(names) == 1 else "sequences ") + ", ".join(repr(s) for s in names)
