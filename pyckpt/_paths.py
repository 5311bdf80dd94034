"""Local files and directories pyckpt writes: creating directories (with errors that say what
is in the way), atomic writes and copies (temp file + fsync + rename + directory fsync).

Below the storage seam: the POSIX backend, the in-memory backend's staging, the checkpoint
manager's step directories and the consolidator all write local files through these."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LOCK_FILE", "TEMP_MARKER", "copy_atomic", "fsync_dir", "fsync_file", "make_dir", "temp_name",
           "write_atomic", "regular_files"]

# The lock file a directory's save holds from set-up to commit (the POSIX backend).
LOCK_FILE = ".pyckpt.lock"

# Marker of a temp file of an interrupted atomic write (``<name>.tmp-<pid>-<n>``).
TEMP_MARKER = ".tmp-"


def make_dir(path: str, what: str = "a pyckpt checkpoint") -> None:
    """Creates directory ``path`` (and its parents) unless it exists.

    Args:
        path: the directory.
        what: what the directory holds, for the message.

    Raises:
        NotADirectoryError: ``path``, or one of its parents, exists and is not a directory (a
            regular file, say); the message names that path and says what to do.
        OSError: any other failure of ``os.makedirs`` (permissions, a full disk...).
    """
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = os.path.abspath(path)
        # The nearest existing path that is not a directory: ``path`` itself or a parent.
        probe = os.path.abspath(path)
        while True:
            if os.path.lexists(probe) and not os.path.isdir(probe):
                blocker = probe
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if os.path.abspath(path) == blocker:
            msg = (f"the path names a file, not a directory ({what} is a directory); choose "
                   "another path or remove the file")
        else:
            msg = f"cannot create the directory for {what}: {blocker} is a file, not a directory"
        raise NotADirectoryError(errno.ENOTDIR, msg, path) from None


def regular_files(directory: str, wanted: Callable[[str], bool] | None = None) -> dict[str, int]:
    """The regular files of ``directory`` (no symbolic links) whose name ``wanted`` accepts
    (default: all), with their sizes. A file removed meanwhile (by another rank of the node) is
    left out."""
    out = {}
    with os.scandir(directory) as it:
        for e in it:
            if wanted is not None and not wanted(e.name):
                continue
            try:
                if e.is_file(follow_symlinks=False):
                    out[e.name] = e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return out


def temp_name(path: str) -> str:
    """A sibling temp name of ``path``, unique per process and thread (``<path>.tmp-<pid>-<n>``,
    which :func:`pyckpt.backends.base.is_stale` recognises)."""
    return f"{path}{TEMP_MARKER}{os.getpid()}-{threading.get_ident()}"


def fsync_file(path: str) -> None:
    """Makes the contents of file ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Makes the entries of directory ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: str, fsync: bool, fill: Any) -> int:
    """Makes file ``path`` through a temp file: ``fill(temp path)`` writes it and returns its
    size; then fsync (``fsync``), rename, directory fsync. Nothing is left under a final or
    temp name when it fails."""
    tmp = temp_name(path)
    try:
        size = int(fill(tmp))
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")
    return size


def write_atomic(path: str, data: bytes, fsync: bool) -> None:
    """Writes ``data`` as file ``path`` atomically (temp + fsync + rename + directory fsync)."""
    def fill(tmp: str) -> int:
        with open(tmp, "wb") as f:
            return f.write(data)

    _atomic(path, fsync, fill)


def copy_atomic(src: str, dst: str, fsync: bool) -> int:
    """Copies file ``src`` to ``dst`` atomically (as :func:`write_atomic`; the kernel's copy
    where it has one); returns its size."""
    def fill(tmp: str) -> int:
        shutil.copyfile(src, tmp)
        return os.path.getsize(tmp)

    return _atomic(dst, fsync, fill)
