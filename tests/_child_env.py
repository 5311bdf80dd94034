"""The environment for a test's child Python process: it imports the same pyckpt as the test.

The checkout's own ``pyckpt/`` has no built extension unless a developer build put one there, so
a child must find pyckpt where the test found it (the installed package in CI, the checkout in a
developer build), never the checkout by default.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyckpt

_TESTS = str(Path(__file__).resolve().parent)


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus ``extra``, with the imported pyckpt's root and tests/ on PYTHONPATH."""
    env = dict(os.environ, **extra)
    root = str(Path(pyckpt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, _TESTS, env.get("PYTHONPATH", "")) if p)
    return env
