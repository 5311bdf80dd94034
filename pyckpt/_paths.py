"""Creating the directories pyckpt writes into, with errors that say what is in the way."""

from __future__ import annotations

import errno
import os

__all__ = ["make_dir"]


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
