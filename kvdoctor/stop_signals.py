"""SIGTERM and SIGHUP handled like Ctrl-C, so what a process holds is closed before it goes.

By default either signal ends a Python process on the spot: no ``finally`` runs, so a
trace loses its closing line, a temporary directory stays behind and a checker prints
no report. Inside ``interrupt_on_stop_signals()`` they raise ``KeyboardInterrupt``
instead, which the code already handles as "stop now, tidily" (the demo closes its
trace, ``kvdoctor check`` stops its workload and reports what it checked). The signals
received are listed, so the process can die of the first one afterwards
(``reraise``) and whoever sent it sees that in the exit status.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["STOP_SIGNALS", "interrupt_on_stop_signals", "reraise"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def interrupt_on_stop_signals() -> Iterator[list[int]]:
    """Within the block, SIGTERM/SIGHUP raise ``KeyboardInterrupt`` in the main thread; yields
    the signals received. Off the main thread (where handlers cannot be set) it changes nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:  # a second signal must not cut short the tidying the first one started
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reraise(received: list[int]) -> None:
    """Die of the first stop signal received, with its default action (nothing if none came)."""
    if received:
        signal.signal(received[0], signal.SIG_DFL)
        os.kill(os.getpid(), received[0])
