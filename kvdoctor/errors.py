"""Errors a user can cause, each with the exit code the CLI reports for it."""

from __future__ import annotations

__all__ = [
    "EXIT_OK", "EXIT_FINDINGS", "EXIT_USAGE", "EXIT_TRACE", "EXIT_ENGINE", "EXIT_CODES",
    "KvdoctorError", "UsageError", "TraceError", "TraceFormatError", "IncompatibleTraceError", "EngineFailure",
]

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_TRACE = 3
EXIT_ENGINE = 4

# What each exit code means, as the CLI's help, README and docs/cli.md say it (a test keeps them equal).
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_FINDINGS: "findings at or above --fail-on",
    EXIT_USAGE: "usage or configuration error",
    EXIT_TRACE: "unreadable or incompatible trace",
    EXIT_ENGINE: "the engine failed while running (out of blocks, a storage or checksum error)",
}


class KvdoctorError(Exception):
    """Base of errors shown to the user as one line; ``exit_code`` is what the CLI returns."""

    exit_code = EXIT_USAGE


class UsageError(KvdoctorError):
    """A bad option, configuration value or missing input the user can fix."""


class EngineFailure(KvdoctorError):
    """kvdoctor's engine failed on a valid configuration (``engine.errors.EngineError``): a CI gate can tell
    "the run broke" from "the command was wrong" (exit 2, which a bad ``EngineConfig`` value still is)."""

    exit_code = EXIT_ENGINE


class TraceError(KvdoctorError):
    """A trace that cannot be read: missing, not a trace, corrupt."""

    exit_code = EXIT_TRACE


class TraceFormatError(TraceError):
    """A malformed line; carries the file and 1-based line number."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


class IncompatibleTraceError(TraceError):
    """A trace of another major version, or not a kvdoctor trace at all."""
