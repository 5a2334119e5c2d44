"""Producers of kvdoctor traces for engines kvdoctor did not write.

Each module here observes another engine in place and writes the same v1 events as
kvdoctor's own engine, so the checks, the TUI and the CI gate need no change per engine.
They import the event contract and the trace writer, never ``kvdoctor.engine``: another
engine's trace must not depend on ours.
"""
