"""``kvdoctor run``: the engine failing while it runs is exit 4; a configuration the engine refuses stays exit 2."""

from __future__ import annotations

import errno

from test_runner_cli import _run, checkpoint  # noqa: F401  (checkpoint: the tiny local checkpoint, a fixture)

from kvdoctor.engine.errors import StorageError
from kvdoctor.engine.serving.scheduler import Scheduler
from kvdoctor.errors import EXIT_ENGINE, EXIT_USAGE


def test_an_engine_failure_while_running_is_exit_4_in_one_line(checkpoint, capsys, monkeypatch):
    # GIVEN a valid run whose engine fails once generation starts (a spill file on a full disk)
    def full_disk(self, *args, **kwargs):
        raise StorageError("disk", "write", errno.ENOSPC, "/tmp/spill", "No space left on device")

    monkeypatch.setattr(Scheduler, "run", full_disk)
    # WHEN it runs
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", "w5 w6", "--max-new-tokens", "4")
    # THEN exit 4, one line saying what failed
    assert code == EXIT_ENGINE and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "the engine failed: disk arena could not write at /tmp/spill" in err


def test_a_bad_knob_or_a_refused_configuration_is_still_exit_2(checkpoint, capsys, monkeypatch):
    # GIVEN a verification mode that does not exist in the environment WHEN the engine is built THEN exit 2
    monkeypatch.setenv("KVDOCTOR_VERIFY", "always")
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", "w5 w6", "--max-new-tokens", "2")
    assert code == EXIT_USAGE and "KVDOCTOR_VERIFY='always': must be one of off, sample, full" in err
    monkeypatch.delenv("KVDOCTOR_VERIFY")
    # GIVEN a value EngineConfig refuses (a block size that is no power of two) THEN exit 2, naming the field
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", "w5 w6", "--block-size", "3")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "block_size" in err, err
