"""Snapshot tests: the screens at 80x24 (the smallest supported) and 120x40, over a fixed trace.

Deterministic on purpose: a seeded synthetic trace, replayed to its end, rates taken from
the trace's clock and no pid in the header. Update with ``--snapshot-update`` after a
deliberate change, and look at the SVGs before committing them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tui_helpers import replay_app, wait_ended

SIZES = [(80, 24), (120, 40)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("screen", ["1", "2", "3", "4", "5"], ids=["overview", "findings", "attention", "memory", "events"])
def test_screens(snap_compare, leak_trace: Path, size: tuple[int, int], screen: str):
    assert snap_compare(replay_app(leak_trace), press=[screen], terminal_size=size, run_before=wait_ended)


def test_help_at_80x24(snap_compare, leak_trace: Path):
    assert snap_compare(replay_app(leak_trace), press=["question_mark"], terminal_size=(80, 24), run_before=wait_ended)
