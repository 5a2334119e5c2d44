"""A newcomer's first mistakes on the command line: each is one line on standard error and the exit code
docs/cli.md documents, before anything slow starts (issue 33, items 6 and 8)."""

from __future__ import annotations

import pytest

from kvdoctor.cli import main
from kvdoctor.errors import EXIT_USAGE


@pytest.mark.parametrize("argv", [
    ["check", "--demo", "--model", "/nonexistent"],
    ["watch", "--demo", "--model", "/nonexistent"],
])
def test_a_model_that_is_not_there_is_a_usage_error_before_the_demo_starts(argv, capsys):
    # WHEN the demo is asked for a checkpoint directory that does not exist
    with pytest.raises(SystemExit) as done:
        main(argv)
    # THEN one line naming it, and exit 2 (not the demo's 15-line traceback and exit 3)
    err = capsys.readouterr().err
    assert done.value.code == EXIT_USAGE
    assert "/nonexistent is not a Hugging Face checkpoint directory" in err and len(err.splitlines()) == 1
