"""Shared test configuration: hypothesis profiles and the helper module path.

Profiles are chosen with ``HYPOTHESIS_PROFILE`` (``dev`` by default, ``ci`` for more examples).
The tests directory is put on ``sys.path`` so that spawned worker processes can import the helper
modules (``_st_workers``) by name.
"""

from __future__ import annotations

import os
import sys

from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
