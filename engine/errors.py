"""Typed errors of the engine, each carrying the numbers a caller needs to react.

``OutOfBlocks`` is an expected condition under memory pressure (a scheduler
preempts on it); ``ChecksumMismatch`` and ``StorageError`` mean a slower tier let
the engine down, and the engine has already put its bookkeeping back in order
when they reach the caller.
"""

from __future__ import annotations

__all__ = ["EngineError", "OutOfBlocks", "ChecksumMismatch", "StorageError", "UnknownSequence", "CacheMisuse"]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class OutOfBlocks(EngineError):
    """No room for ``requested`` blocks in ``tier`` even after demoting what the policy allows."""

    def __init__(self, tier: str, requested: int, free: int) -> None:
        tier = str(tier)  # a Tier prints as its name, like the plain string
        super().__init__(f"out of KV blocks in tier {tier!r}: requested {requested}, free {free}")
        self.tier, self.requested, self.free = tier, requested, free


class ChecksumMismatch(EngineError):
    """A block read back from ``tier`` does not match the checksum taken when it left the faster tier.

    The corrupt copy is discarded; the block stays where it was, so the caller may
    drop the sequence or recompute it.
    """

    def __init__(self, block: int, tier: str, expected: int, actual: int) -> None:
        tier = str(tier)
        super().__init__(
            f"checksum mismatch on block {block} read from {tier!r}: "
            f"expected {expected:#018x}, got {actual:#018x}"
        )
        self.block, self.tier, self.expected, self.actual = block, tier, expected, actual


class StorageError(EngineError):
    """An arena could not get or use its memory (disk full, permission denied, a spill file cut short, ...).

    Carries the OS ``errno`` (None when no call failed, as for a file cut short under the engine) and the
    path involved, so the message can say what to fix; ``blocks``: the blocks whose bytes were lost
    (empty when nothing was lost and only a move failed), so a scheduler fails exactly their requests.
    """

    def __init__(self, tier: str, op: str, errno: int | None, path: str | None, reason: str,
                 blocks: tuple[int, ...] = ()) -> None:
        tier = str(tier)
        where = f" at {path}" if path else ""
        super().__init__(f"{tier} arena could not {op}{where}: {reason}")
        self.tier, self.op, self.errno, self.path, self.reason = tier, op, errno, path, reason
        self.blocks = tuple(blocks)


class UnknownSequence(EngineError, KeyError):
    """An operation named a sequence the cache does not hold."""

    def __init__(self, seq: object) -> None:
        super().__init__(f"unknown sequence {seq!r}")
        self.seq = seq

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class CacheMisuse(EngineError, ValueError):
    """``EngineCache`` used in a way that would compute wrong K/V or fail deep inside the model: another
    model's shapes, or a batch of another size on rows an earlier ``generate`` call left. ``what`` names
    the misuse (``"shapes"``, ``"batch"``); the message says what the cache holds, what came and what to do."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what
