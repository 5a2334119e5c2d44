"""Observers never harm their host: the one place a producer's own failure inside vLLM or transformers is caught.

kvdoctor's producers wrap methods of engines it did not write. A wrapper runs the host's original exactly
as it was called, whatever the signature (vLLM calls the same method positionally in one path and by
keyword in another), and keeps its bookkeeping apart: a ``before`` that may only look at the arguments,
an ``after`` that sees the result. Bookkeeping can fail — a vLLM release that renamed an attribute, a full
disk under the trace — and the host must never see it. The first failure records one ``observer_error``
(what was being traced, the exception, where in kvdoctor), stops the producer, and from then on every
wrapper only calls the host: a doctor that loses sight says so in the trace (``kvdoctor check`` fails on
it) and never takes the patient down with it.
"""

from __future__ import annotations

import inspect
import sys
import traceback
from typing import Any, Callable

from ..events import ObserverError

__all__ = ["Call", "Guard", "positions"]

_NO_DEFAULT = inspect.Parameter.empty


def positions(original: Callable) -> dict[str, tuple[int | None, Any]]:
    """Each parameter's name -> (position it may be passed at, or None if keyword-only; its default)."""
    try:
        params = inspect.signature(original).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: arguments by keyword only
        return {}
    out: dict[str, tuple[int | None, Any]] = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[p.name] = (i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None, p.default)
    return out


class Call:
    """One call of a host method as the host made it: its arguments by name, however they were passed."""

    __slots__ = ("args", "kwargs", "_positions")

    def __init__(self, positions: dict[str, tuple[int | None, Any]], args: tuple, kwargs: dict) -> None:
        self.args = args
        self.kwargs = kwargs
        self._positions = positions

    def __getitem__(self, name: str) -> Any:
        """The argument ``name``, passed by position or keyword, else its default; KeyError when absent."""
        if name in self.kwargs:
            return self.kwargs[name]
        index, default = self._positions.get(name, (None, _NO_DEFAULT))
        if index is not None and index < len(self.args):
            return self.args[index]
        if default is not _NO_DEFAULT:
            return default
        raise KeyError(f"the host called without argument {name!r}")

    def first(self) -> Any:
        """The first argument, however it was passed (None when there is none)."""
        if self.args:
            return self.args[0]
        name = next(iter(self._positions), None)
        return self.kwargs.get(name) if name is not None else next(iter(self.kwargs.values()), None)

    def replace(self, name: str, value: Any) -> None:
        """Pass ``value`` for ``name`` where the host passed its own (a one-shot iterator read into a list)."""
        if name in self.kwargs:
            self.kwargs = {**self.kwargs, name: value}
            return
        index = self._positions[name][0]
        if index is None or index >= len(self.args):
            raise KeyError(f"the host called without argument {name!r}")
        self.args = (*self.args[:index], value, *self.args[index + 1:])


class Guard:
    """Runs a producer's bookkeeping around a host's methods; the first failure stops the producer.

    ``record`` takes the ``observer_error`` (the producer writes and closes its trace), ``stop`` puts the
    host's methods back. Both run once, and a failure inside them is swallowed: nothing escapes.
    """

    def __init__(self, producer: str, record: Callable[[ObserverError], None], stop: Callable[[], None]) -> None:
        self.producer = producer
        self.live = True
        self._record = record
        self._stop = stop

    def lost(self, part: str, exc: BaseException) -> None:
        """Bookkeeping of ``part`` failed: one ``observer_error``, tracing stops, one line on stderr."""
        if not self.live:
            return
        self.live = False
        message = str(exc)[:500]
        event = ObserverError(producer=self.producer, part=part, error=type(exc).__name__, message=message,
                              where=_where(exc))
        for step in (lambda: self._record(event), self._stop):
            try:
                step()
            except Exception:  # the trace may be what failed (a full disk): the host goes on regardless
                pass
        try:
            sys.stderr.write(f"kvdoctor: lost track of {self.producer} in {part} ({event.error}: {message}); "
                             f"tracing stopped, {self.producer} goes on\n")
        except Exception:
            pass

    def attempt(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as bookkeeping of ``part``: its result, or None once it failed (and tracing
        stopped). A hook the host calls (a forward hook) that returns None leaves the host's values alone."""
        if not self.live:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.lost(part, exc)
            return None

    def hook(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a callback for the host (a forward hook, an attention tap): guarded, result None on failure."""
        return lambda *args, **kwargs: self.attempt(part, fn, *args, **kwargs)

    def wrap(self, original: Callable, part: str, *, before: Callable[[Call], Any] | None = None,
             after: Callable[[Call, Any, Any], None] | None = None,
             restore: Callable[[Any], None] | None = None) -> Callable:
        """``original`` with ``before(call) -> state`` and ``after(call, result, state)`` around it.

        ``restore(state)`` runs after the host even when the host raised (a context set by ``before``),
        and must be a plain assignment that cannot fail. The host's own exceptions pass through untouched.
        """
        positions_of = positions(original)
        guard = self

        def call(*args: Any, **kwargs: Any) -> Any:
            if not guard.live:
                return original(*args, **kwargs)
            c = Call(positions_of, args, kwargs)
            state = None
            if before is not None:
                try:
                    state = before(c)
                except Exception as exc:
                    guard.lost(part, exc)
                    return original(*c.args, **c.kwargs)
            try:
                result = original(*c.args, **c.kwargs)
            finally:
                if restore is not None:
                    restore(state)
            if after is not None and guard.live:
                try:
                    after(c, result, state)
                except Exception as exc:
                    guard.lost(part, exc)
            return result

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call


def _where(exc: BaseException) -> str | None:
    """The innermost frame of kvdoctor's own code in ``exc``'s traceback, as ``path:line``."""
    where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if "kvdoctor" in frame.filename.replace("\\", "/").split("/site-packages/")[-1]:
            where = f"kvdoctor/{frame.filename.rsplit('/kvdoctor/', 1)[-1]}:{frame.lineno}"
    return where
