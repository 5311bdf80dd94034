"""Private mount namespaces for test ranks that pretend to be nodes of one machine.

A rank moves into a mount namespace of its own (what ``unshare -m --propagation private``
does), binds its node's directories onto the paths every rank uses, and hides the directory of
all nodes under an empty tmpfs: no path then reaches another node's files. Needs
CAP_SYS_ADMIN (root in a container, the normal test environment); :func:`namespace_refusal`
says when it is refused. Imports nothing heavy: the probe runs in a bare interpreter.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _libc_call(libc: Any, name: str, *args: Any) -> None:
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args}: {os.strerror(err)}")


def namespace_refusal() -> str | None:
    """Why a private mount namespace cannot be made here (None when it can)."""
    code = (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"sys.exit(0 if libc.unshare({CLONE_NEWNS}) == 0 and "
        f"libc.mount(None, b'/', None, {MS_REC | MS_PRIVATE}, None) == 0 else 1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    if proc.returncode != 0:
        return "unshare(CLONE_NEWNS) + mount are refused here (needs CAP_SYS_ADMIN)"
    return None


def unshare_mounts() -> None:
    """Moves this (single-threaded) process into a mount namespace of its own, its mounts
    private (nothing propagates back to the machine's namespace).

    Raises:
        OSError: the namespace is refused (no CAP_SYS_ADMIN).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    _libc_call(libc, "unshare", CLONE_NEWNS)
    _libc_call(libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None)


def bind_and_hide(binds: list[tuple[str, str]], hide: str) -> None:
    """In the namespace :func:`unshare_mounts` made: binds each ``(source, target)`` directory,
    then mounts an empty tmpfs over ``hide`` (which may hold the sources: the binds stay)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for source, target in binds:
        _libc_call(libc, "mount", os.fsencode(source), os.fsencode(target), None, MS_BIND, None)
    mount_tmpfs(hide)


def mount_tmpfs(path: str, options: str | None = None) -> None:
    """Mounts an empty tmpfs on ``path`` (``options``: e.g. ``"size=16k"``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    _libc_call(libc, "mount", b"tmpfs", os.fsencode(path), b"tmpfs", 0,
               None if options is None else options.encode())
