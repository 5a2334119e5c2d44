"""Where the engine keeps what it builds once per machine: converted models, compiled kernels, calibrations.

One root (``$XDG_CACHE_HOME/kvdoctor``, else ``~/.cache/kvdoctor``) so a user clears everything kvdoctor
cached by removing one folder.
"""

from __future__ import annotations

from pathlib import Path

from .. import knobs

__all__ = ["cache_home"]


def cache_home() -> Path:
    base = knobs.get(knobs.XDG_CACHE_HOME) or str(Path.home() / ".cache")
    return Path(base) / "kvdoctor"
