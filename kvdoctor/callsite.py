"""The user's own frames at a call into a KV cache: where a sequence started, a block was allocated, a request ended.

A leak's finding helps as much as the line it names, and the line that matters is in the user's script
(the ``generate`` call, the request loop, the abort), not in kvdoctor, vLLM, torch or transformers. A
producer calls ``user_stack()`` on ``seq_start``, on a sequence's first ``alloc`` and on ``seq_end``,
and puts the frames in the event's ``stack``; the checks hand them to the findings those events cause.

It is cheap enough to leave on: producers call it per sequence, not per token, and a walk costs a
``dict`` lookup per frame, because whether a code object is the user's (and the path to show for it)
is decided once per code object and cached.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from types import CodeType

__all__ = ["user_stack", "MAX_FRAMES"]

MAX_FRAMES = 8  # the user's innermost frames kept: the call, and the few that led to it

# id(code) -> (code, the path to show for the user's code or None for a library's): keyed by id because
# hashing a code object hashes its bytecode; the code object is kept, so its id is never reused meanwhile.
_VERDICT: dict[int, tuple[CodeType, str | None]] = {}
_MAX_VERDICTS = 65536


def _library_roots() -> tuple[str, ...]:
    """Folders whose code is never the user's: kvdoctor's own (its three source roots, which an editable
    install keeps apart), the standard library, and every installed package (torch, transformers, vLLM)."""
    here = Path(__file__).resolve().parent
    roots = {str(here), str(here.parent / "engine"), str(here.parent / "checks")}
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(name)
        if path:
            roots.add(str(Path(path).resolve()))
    return tuple(root.rstrip(os.sep) + os.sep for root in roots)


_ROOTS = _library_roots()


def _classify(code: CodeType) -> str | None:
    """The path to show for ``code``'s file when it is the user's; None when it is a library's."""
    filename = code.co_filename
    if filename.startswith("<") and not filename.startswith(("<stdin", "<ipython")):
        return None  # frozen importlib, exec'd strings: nobody's file to open
    path = os.path.realpath(filename) if os.path.isabs(filename) else os.path.abspath(filename)
    parts = path.split(os.sep)
    if path.startswith(_ROOTS) or "site-packages" in parts or "dist-packages" in parts:
        return None
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path  # relative: the same on every checkout


def user_stack(limit: int = MAX_FRAMES) -> list[str] | None:
    """The caller's innermost ``limit`` frames outside kvdoctor and the libraries, as ``"file:line function"``
    (innermost first; a file under the working directory relative to it); None when every frame is a library's
    (kvdoctor's own demo, a server's worker thread)."""
    frame = sys._getframe(1)
    out: list[str] = []
    verdicts = _VERDICT
    while frame is not None:
        code = frame.f_code
        known = verdicts.get(id(code))
        if known is None or known[0] is not code:
            if len(verdicts) >= _MAX_VERDICTS:  # code made at run time (exec, templates) must not pile up
                verdicts.clear()
            known = verdicts[id(code)] = (code, _classify(code))
        if known[1] is not None:
            out.append(f"{known[1]}:{frame.f_lineno} {code.co_qualname}")
            if len(out) == limit:
                break
        frame = frame.f_back
    return out or None
