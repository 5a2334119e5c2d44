"""The tier mover's asynchronous copies as the trace's transfers: a prefetch job is one ``transfer_start`` with
``op`` ``move`` over its blocks, closed by ``transfer_done`` when its copy has landed (seen when the first of its
blocks is settled) or ``transfer_failed`` when the copy failed.

A move copies blocks the engine keeps: they stay valid where they were until it is done, and a failed one
leaves them there, so its failure loses nothing (``checks/transfer`` reads a failed ``load`` otherwise); a copy
that landed with wrong bytes is the swap-in's ``checksum_error``, not a failed transfer. What the transfer
vocabulary adds to the ``prefetch``/``swap_in`` events is the flight between them: a block freed, written or
handed out while its copy may still land is visible to the checks, as on any engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ...events import TransferDone, TransferFailed, TransferStart
from ..bus import Bus

__all__ = ["Transfer", "Transfers"]


@dataclass(slots=True)
class Transfer:
    """One prefetch job: its id, whether it is still open in the trace, and (free-during-prefetch) the gate its
    copy waits at."""

    id: str
    open: bool = True
    gate: threading.Event | None = None


class Transfers:
    """Ids and events of the mover's transfers. ``held``: the free-during-prefetch fault is on, and each copy
    waits at its ``gate`` (a slow link) until a step waits for it or the mover lets it go (``release``)."""

    def __init__(self, bus: Bus, *, held: bool = False) -> None:
        self.bus = bus
        self.held = held
        self._count = 0
        self._held: list[Transfer] = []  # free-during-prefetch: copies waiting at their gates

    def start(self, blocks: Sequence[Any], src: str, dst: str) -> Transfer:
        """A prefetch of ``blocks`` (``pool.Block``) from ``src`` to ``dst`` begins; named by their one owner."""
        self._count += 1
        transfer = Transfer(f"prefetch-{self._count}", gate=threading.Event() if self.held else None)
        if self.held:
            self._held.append(transfer)
        if self.bus.enabled:
            owners = {b.owners[0] if b.owners else None for b in blocks}
            self.bus.emit(TransferStart, transfer=transfer.id, op="move", blocks=[b.id for b in blocks],
                          seq=owners.pop() if len(owners) == 1 else None, src=src, dst=dst)
        return transfer

    def finished(self, transfer: Transfer, failed: str | None = None) -> None:
        """``transfer``'s copy is over (``failed``: why it failed); closed once, by the first block settled."""
        if not transfer.open:
            return
        transfer.open = False
        if not self.bus.enabled:
            return
        if failed is None:
            self.bus.emit(TransferDone, transfer=transfer.id)
        else:  # a move that failed leaves its blocks valid where they were
            self.bus.emit(TransferFailed, transfer=transfer.id, reason=failed)

    def abandon(self, transfer: Transfer) -> None:
        """free-during-prefetch: the mover stopped waiting for ``transfer``'s copy; it lands at the step's end
        (``release``), wherever its slots went meanwhile, and the transfer is never closed."""
        transfer.open = False

    def release(self, *, every: bool = False) -> None:
        """Let the abandoned copies go ahead (the step's end), or ``every`` held one (before something waits for
        all copies: a held copy nobody lets go of would be waited for forever)."""
        for transfer in self._held:
            if every or not transfer.open:
                transfer.gate.set()
        self._held = [t for t in self._held if not t.gate.is_set()]
