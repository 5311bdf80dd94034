"""pyckpt.consolidate with a source or destination that the native consolidator cannot open
in place (an object store, an in-memory store): inputs are staged into local temp files and
outputs uploaded through the backend.

Moved here from the object-store module so the consolidation drives its own steps (the
backends know nothing of consolidation; this module holds backend objects only).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

from pyckpt._collective import agree, group_info
from pyckpt._consolidate.plan import INDEX_NAME
from pyckpt.backends import Backend

logger = logging.getLogger("pyckpt.consolidate")

__all__ = ["consolidate_staged"]

_TEMP_PREFIX = "pyckpt-consolidate-"


def _withdraw_index(dst: Backend) -> None:
    """Removes an earlier export's index from ``dst`` before any file is stored: while its
    files are replaced one by one (or after a failure part way) it would name a mix of the
    earlier export's files and this one's. The new index, stored last, marks the export."""
    dst.remove_files([dst.url_of(INDEX_NAME)], strict=True)


# A staged copy's path, on this rank or another (errors travel between ranks): the temp
# directory made below, then "src/" and a plain file name.
_STAGED = re.compile(r"/[^\s'\"]*?" + re.escape(_TEMP_PREFIX) + r"[^/\s'\"]+/src/([A-Za-z0-9._-]+)")


def _name_the_source(e: BaseException, src: Backend) -> None:
    """``e`` with the paths of staged copies replaced by what they are copies of (an error
    naming a temp file, deleted by the time it is read, helps no one)."""

    def fix(text: str) -> str:
        return _STAGED.sub(lambda m: src.url_of(m.group(1)), text)

    if isinstance(e, OSError):
        if isinstance(e.filename, str):
            e.filename = fix(e.filename)
        if e.strerror:
            e.strerror = fix(e.strerror)
    elif e.args and isinstance(e.args[0], str):
        e.args = (fix(e.args[0]), *e.args[1:])


def consolidate_staged(run: Callable[..., Any], src: Backend, dst: Backend, *,
                       process_group: Any, batch_bytes: int | None = None, **kwargs: Any) -> Any:
    """:func:`pyckpt.consolidate` where ``src`` or ``dst`` cannot be opened in place by the
    native consolidator (``Backend.in_place`` is False: ``s3://``, ``memory://``).

    One process: a source checkpoint is staged into a temp directory (``Backend.stage``), the
    outputs are written into one and then stored through ``dst`` (the index last, with one
    PUT, so it names only complete objects).

    Several ranks: each rank stages the validated ``pyckpt.json`` and only its share of the
    data files (each to one rank, balanced by bytes) into a private temp directory (a local
    ``src`` is read in place, shared or node-local); all ranks then run ``run(...,
    shared_filesystem=False)`` over ``process_group`` into a private temp directory (or, for a
    local ``dst``, into each rank's own ``dst``, laid out as node-local consolidation lays it
    out). Each rank stores the files it wrote; once every rank has succeeded, rank 0 stores the
    index, last. On any rank's failure no index is stored, the objects this call stored are
    removed (best effort) and every rank raises.

    Errors found in staged inputs (a checksum mismatch, a truncated file) name the source's
    URL, not the temp copy.

    Raises:
        ValueError: ``dedup_tied`` with several ranks (as with ``shared_filesystem=False``).
        NotImplementedError: several ranks and a local ``src`` that is not a pyckpt checkpoint.
    """
    group = group_info(process_group)
    with tempfile.TemporaryDirectory(prefix=_TEMP_PREFIX) as tmp:
        staged = os.path.join(tmp, "src")
        local_src = src.location if src.in_place else staged
        local_dst = dst.location if dst.in_place else os.path.join(tmp, "dst")
        try:
            if group.world == 1:
                if not src.in_place:
                    src.stage(staged)
                res = run(local_src, local_dst, process_group=process_group,
                          shared_filesystem=not src.exchanges_chunks, batch_bytes=batch_bytes,
                          **kwargs)
                if dst.in_place:
                    return res
                dst.check()
                _withdraw_index(dst)
                files = [dst.put_file(p) for p in res.files]
                index = dst.put_file(res.index_path, last=True)  # last: complete files
                return dataclasses.replace(res, files=files, index_path=index)
            return _on_ranks(run, src, dst, group, process_group, local_src, local_dst, staged,
                             batch_bytes, kwargs)
        except Exception as e:
            if not src.in_place:
                _name_the_source(e, src)  # rewritten in place; raised with its traceback
            raise


def _on_ranks(run: Callable[..., Any], src: Backend, dst: Backend, group: Any,
              process_group: Any, local_src: str, local_dst: str, staged: str,
              batch_bytes: int | None, kwargs: dict[str, Any]) -> Any:
    if kwargs.get("dedup_tied") is None:  # the default: off in the node-local mode
        kwargs = {**kwargs, "dedup_tied": False}
    elif kwargs["dedup_tied"] is not False:  # refused by the node-local mode
        raise ValueError(
            "dedup_tied is not supported by pyckpt.consolidate with s3:// URLs on several ranks"
        )
    if src.in_place:
        def check_source() -> None:
            from pyckpt._consolidate.scan import is_pyckpt

            if not is_pyckpt(local_src):
                raise NotImplementedError(
                    f"{local_src}: pyckpt.consolidate to an s3:// destination on several ranks "
                    "needs a pyckpt checkpoint (pyckpt.json); consolidate safetensors inputs on "
                    "one rank"
                )

        agree(check_source, group, ranks="root", what="checking the source")

    def prepare() -> None:
        if not dst.in_place:
            dst.check()
        if not src.in_place:
            names = src.stage(staged, (group.rank, group.world))
            logger.info(
                "rank %d/%d downloaded %d data object(s) of %s", group.rank, group.world,
                len(names), src.location, extra={"pyckpt_staged": list(names)},
            )

    agree(prepare, group, what="downloading the source")
    res = run(local_src, local_dst, process_group=process_group, shared_filesystem=False,
              batch_bytes=batch_bytes, **kwargs)
    if dst.in_place:
        return res
    uploaded: list[str] = []

    def upload() -> list[str]:
        for p in res.files:
            uploaded.append(dst.put_file(p))
        return list(uploaded)

    def drop() -> None:  # best effort: the objects this rank uploaded
        dst.remove_files(uploaded)

    agree(lambda: _withdraw_index(dst), group, ranks="root", what="withdrawing the earlier index")
    _, per_rank = agree(upload, group, on_failure=drop, what="upload")
    index_url, _ = agree(lambda: dst.put_file(res.index_path, last=True), group,
                         ranks="root", on_failure=drop, what="index upload")
    files = sorted((u for urls in per_rank for u in urls), key=lambda u: u.rsplit("/", 1)[-1])
    return dataclasses.replace(res, files=files, index_path=index_url)
