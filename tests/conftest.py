"""Hypothesis profiles: CI draws the same examples every run, a developer's run explores new ones.

A property test that fails one random draw in thirty would otherwise fail CI at random (two did, on
tolerances, in one day); derandomized, a CI failure reproduces, and `./kvd test` run by hand still
searches afresh. ``.ci/run`` selects the profile with ``KVDOCTOR_HYPOTHESIS=ci``.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("KVDOCTOR_HYPOTHESIS", "explore"))
