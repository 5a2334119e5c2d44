"""The ``kvdoctor`` command line: one subcommand per module in ``kvdoctor.commands``.

Exit codes (``errors.EXIT_CODES``, listed in README and docs/cli.md, relied on by CI gates):
0 ok; 1 findings at or above ``--fail-on``; 2 usage or configuration error;
3 unreadable or incompatible trace; 4 the engine failed while running. Bad input is one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import NoReturn

from . import commands, knobs
from .errors import EXIT_CODES, EXIT_USAGE, KvdoctorError

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with kvdoctor's error style: a bad option is one line on stderr and exit 2, not
    the usage block (subcommands' parsers are of this class too); ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions and epilogs paragraph by paragraph (blank-line separated), but keeps a paragraph
    with indented lines as written: a list, such as the faults with what each breaks."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line[:1].isspace() for line in lines[1:]):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(super()._fill_text(para, width, indent))
        return "\n\n".join(out)


def one_line(message: str) -> str:
    """``message`` as one printable line: a line break or control character from the user's input
    (a file name, an option's value) is shown escaped, so an error never spans lines."""
    if message.isprintable():
        return message
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)


def _version() -> str:
    """The installed distribution's version (what a bug report should name)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvdoctor")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvdoctor",
        description="Memory diagnostics and debugging for the KV cache of LLM inference.",
        epilog="exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()),
    )
    parser.add_argument("--version", action="version", version=f"kvdoctor {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Each command module is light at import (heavy imports live inside its run()), so
    # `kvdoctor check --trace x` starts without torch.
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP, formatter_class=_Formatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KvdoctorError as exc:
        print(f"kvdoctor {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except knobs.KnobError as exc:  # a KVDOCTOR_* variable set to a value it does not accept (docs/knobs.md)
        print(f"kvdoctor {args.command}: {one_line(str(exc))} (docs/knobs.md)", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _entry()
