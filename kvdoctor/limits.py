"""How much a long run may remember: the bounds that keep ``check --follow`` and the TUI flat.

Everything kvdoctor keeps per *live* sequence or block is bounded by the workload itself (an
engine holds so many blocks); what it keeps about the *past* (freed blocks, ended sequences)
would grow with every request served, so each kind has a bound here, set in the config file:

    [tool.kvdoctor.limits]
    freed_blocks = 4096        # freed block ids whose last life the checks keep as evidence
    ended_seqs = 65536         # ended sequence ids remembered, to name a batch row of one
    tui_freed_blocks = 4096    # freed blocks the TUI's block map and detail pane keep
    tui_ended_seqs = 2000      # ended sequences the TUI keeps for search and detail

Per-block histories (``history``), findings (``max_findings_per_rule``) and the TUI's
sparklines, log and findings list are bounded as well (see docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Limits"]

_MAX = 10_000_000


@dataclass(frozen=True)
class Limits:
    freed_blocks: int = 4096
    ended_seqs: int = 65536
    tui_freed_blocks: int = 4096
    tui_ended_seqs: int = 2000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not 0 <= value <= _MAX:
                raise ValueError(f"limits.{f.name} must be in [0, {_MAX}], got {value}")
