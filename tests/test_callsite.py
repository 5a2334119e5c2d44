"""The user's frames at a call into a cache: library and kvdoctor frames skipped, the user's kept innermost
first, with paths relative to the working directory, and cheap enough to take per sequence."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from kvdoctor.callsite import user_stack
from kvdoctor.findings import split_frame


def _through_a_library(limit: int = 8):
    """``user_stack`` called from code that lives in site-packages, as torch or transformers would call it."""
    library = Path(sysconfig.get_paths()["purelib"]) / "somelib" / "cache.py"
    scope: dict = {"user_stack": user_stack, "limit": limit}
    exec(compile("def allocate():\n    return user_stack(limit)\n", str(library), "exec"), scope)
    return scope["allocate"]()


def test_the_stack_starts_at_the_users_own_line_and_skips_the_libraries():
    # WHEN a library function records the stack on behalf of this test
    frames = _through_a_library()
    # THEN the first frame is the user's call into the library, relative to the working directory
    path, line, function = split_frame(frames[0])
    assert (Path(path).name, function) == ("test_callsite.py", "_through_a_library")
    assert not Path(path).is_absolute() and line > 0
    # AND the next is the test that called it; no frame is the library's, pytest's or kvdoctor's
    assert split_frame(frames[1])[2] == "test_the_stack_starts_at_the_users_own_line_and_skips_the_libraries"
    assert not any("somelib" in f or "site-packages" in f or "/kvdoctor/" in f for f in frames)


def test_the_same_call_gives_the_same_frames_and_honours_the_limit():
    assert _through_a_library() == _through_a_library()
    assert len(_through_a_library(limit=1)) == 1


def test_only_library_frames_give_no_stack():
    library = Path(sysconfig.get_paths()["purelib"]) / "somelib" / "server.py"
    scope: dict = {"user_stack": user_stack}
    exec(compile("import threading\nout = []\nt = threading.Thread(target=lambda: out.append(user_stack()))\n"
                 "t.start(); t.join()\n", str(library), "exec"), scope)
    assert scope["out"] == [None]
