"""Backends: the places a checkpoint lives, behind one seam (:class:`~.base.Backend`).

:func:`open_backend` is the only place that reads a URL scheme or the node-local choice;
everything above it (``Writer``, ``Reader``, ``verify``, ``inspect``, ``consolidate``, the CLI)
holds a backend object. Backends:

==================  ===========================================  ============================
location            backend                                      module
==================  ===========================================  ============================
a path              a directory, shared by the ranks             :mod:`.posix`
a path, node-local  each rank's directory + chunks from peers    :mod:`.peer` (over :mod:`.posix`)
``s3://b/prefix``   an object-store prefix (obstore)             :mod:`.s3`
``memory://name``   a store in this process                      :mod:`.memory`
==================  ===========================================  ============================
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pyckpt import _options
from pyckpt.backends.base import Backend, SaveState, clean_up, commit_save

__all__ = ["Backend", "SaveState", "check_part_bytes", "child_location", "clean_up",
           "commit_save", "is_remote", "node_local_choice", "open_backend", "scheme_of"]

# Schemes served, and any other "scheme://" (two letters or more, so no drive letter): refused,
# never taken for a local path.
SCHEMES = ("s3", "memory")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")


def scheme_of(location: Any) -> str | None:
    """The URL scheme of ``location`` (``"s3"``, ``"memory"``), or None for a local path.

    Raises:
        ValueError: a URL of any other scheme (``gs://``, ``az://``, ``file://``, ``S3://``...),
            naming it. Taken as a path, ``gs://bucket/ckpt`` would be the relative directory
            ``gs:/bucket/ckpt``: a save would land on the local disk while its caller believed
            it was in the bucket.
    """
    if not isinstance(location, str):
        return None
    m = _URL.match(location)
    if m is None:
        return None
    if m.group(1) in SCHEMES:
        return m.group(1)
    raise ValueError(
        f"{location}: unsupported URL scheme {m.group(1)!r}; pyckpt reads and writes local "
        "paths, s3:// URLs (Amazon S3 and S3-compatible stores) and memory:// stores"
    )


def is_remote(location: Any) -> bool:
    """Whether ``location`` is a URL (not a local path); refuses foreign schemes."""
    return scheme_of(location) is not None


def child_location(location: str | os.PathLike[str], name: str) -> str:
    """The location named ``name`` directly under ``location`` (a sub-directory, a sub-prefix,
    or the store ``memory://name/child``), as :meth:`Backend.list_children` names it. A path is
    made absolute (a later ``chdir`` does not move it).

    Raises:
        ValueError: ``name`` is not a plain name (empty, ``.``, ``..``, or with a separator), or
            ``location`` is a URL of an unsupported scheme.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{os.fspath(location)}: illegal child name {name!r}")
    path = os.fspath(location)
    if scheme_of(path) is None:
        return os.path.join(os.path.abspath(path), name)
    return f"{path.rstrip('/')}/{name}"


def check_part_bytes(part_bytes: int | None) -> int:
    """A multipart part size for object stores, validated (None: the default, 16 MiB).

    Raises:
        ValueError: outside the store's limits.
    """
    from pyckpt.backends.s3.upload import check_part_bytes as check

    return check(part_bytes)


def node_local_choice(value: Any) -> bool | Literal["auto"]:
    """``shared_filesystem`` as given to a Reader or Writer, normalised: True, False or
    ``"auto"``.

    Raises:
        ValueError: another string.
    """
    if isinstance(value, str):  # "auto", any case
        value = _options.canonical(value, ("auto",)) or value
    if isinstance(value, str) and value != "auto":
        raise ValueError(f"shared_filesystem must be True, False or 'auto' (any case), "
                         f"got {value!r}")
    return "auto" if value == "auto" else bool(value)


def open_backend(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    shared_filesystem: bool | Literal["auto"] = True,
    process_group: Any = None,
    part_bytes: int | None = None,
    direct_io: str | None = None,
    fsync: bool | None = None,
) -> Backend:
    """The backend of ``location``.

    Args:
        location: a directory path, ``s3://bucket/prefix`` or ``memory://name``.
        storage_options: object-store client settings (docs/OBJECT_STORES.md).
        shared_filesystem: for a path: True (one directory every rank sees), False (node-local:
            each rank's directory holds its node's files, see :mod:`.peer`) or ``"auto"``
            (decided when a load starts). URLs take only True.
        process_group: the group of a node-local checkpoint.
        part_bytes: multipart part size (object stores).
        direct_io, fsync: data-file writing (directories).

    Raises:
        ValueError: an unsupported URL scheme, a malformed URL, or ``shared_filesystem`` other
            than True for a URL.
        ImportError: an ``s3://`` URL without the ``obstore`` client.
    """
    path = os.fspath(location)
    scheme = scheme_of(path)
    if scheme is not None and shared_filesystem is not True:
        raise ValueError(f"{path}: shared_filesystem=False is for node-local directories, "
                         "not object-store URLs")
    if scheme == "s3":
        from pyckpt.backends.s3 import S3Backend

        return S3Backend(path, storage_options, part_bytes=part_bytes)
    if scheme == "memory":
        from pyckpt.backends.memory import MemoryBackend

        return MemoryBackend(path)
    from pyckpt.backends.posix import PosixBackend

    if shared_filesystem is True:
        return PosixBackend(path, direct_io=direct_io, fsync=fsync)
    from pyckpt.backends.peer import PeerBackend

    local = PosixBackend(path, direct_io=direct_io, fsync=fsync)
    return PeerBackend(local, process_group, auto=shared_filesystem == "auto")
