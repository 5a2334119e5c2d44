"""The engine's deliberate faults as the command line offers them: one ``--fault`` option and one list, with
what each fault breaks, for ``run``, ``watch`` and ``check`` (the names and descriptions are the engine's own
registry, ``engine.faults.FAULTS``, which imports no torch, so ``--help`` stays fast)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from .engine.faults import FAULTS

__all__ = ["FAULT_NAMES", "add_fault_argument", "fault_list"]

FAULT_NAMES = tuple(FAULTS)
_WIDTH = 76  # an 80-column terminal, less the indent


def fault_list() -> str:
    """Every fault with what it breaks, as a help epilog: the name, then its description indented below."""
    lines = ["faults (--fault NAME; the checks should find each one):"]
    for name, what in FAULTS.items():
        lines.append(f"  {name}")
        lines += textwrap.wrap(what, _WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def add_fault_argument(parser: argparse.ArgumentParser, container: Any = None, *, applies: str = "",
                       **options: Any) -> None:
    """``--fault NAME`` on ``container`` (an argument group of ``parser``, or ``parser`` itself), with the fault
    list appended to ``parser``'s epilog; ``applies`` says which sources take it ("with --demo: ")."""
    (container or parser).add_argument(
        "--fault", metavar="NAME",
        help=f"{applies}switch on one of the engine's deliberate bugs, so the checks have a real one to find "
        "(the list below; KVDOCTOR_FAULT does the same)", **options)
    parser.epilog = (parser.epilog + "\n\n" if parser.epilog else "") + fault_list()
