"""Compares two parsed checkpoint indexes value by value (the native reader's against the Python
validator's): every field, the order of tensors, bytes items and pieces, each segment's path,
codec fields and chunk records."""

from __future__ import annotations

from typing import Any

from pyckpt import _format


def _segments(segments: list[Any]) -> list[Any]:
    return [(path, raw_begin, _format.codec_params_json(params), [tuple(c) for c in chunks])
            for path, raw_begin, params, chunks in segments]


def plain(index: _format.CheckpointIndex) -> tuple[Any, ...]:
    """``index`` as plain values that compare equal exactly when the indexes agree."""
    tensors = [(name, t.fqn, t.dtype, t.shape, t.requires_grad, t.memory_format,
                [(p.offsets, p.sizes, p.nbytes, _segments(p.segments)) for p in t.pieces])
               for name, t in index.tensors.items()]
    items = [(name, b.fqn, b.nbytes, _segments(b.segments))
             for name, b in index.bytes_items.items()]
    return (index.path, tensors, items, list(index.files.items()), index.save_id,
            index.dcp_version, repr(index.planner_data), index.storage_meta, index.created_by,
            index.version, sorted(index.local_files))


def python_index(root: str, raw: bytes, *, all_files: bool = True,
                 validator: Any = None) -> _format.CheckpointIndex:
    """The Python validator's index of the metadata bytes ``raw`` of checkpoint ``root``
    (``validator``: a fresh one of a backend's own class, else the directory's)."""
    from pyckpt import _format_read

    meta = f"{root}/{_format.METADATA_FILE}" if validator is None else validator.meta
    doc, version = _format_read._parse([raw], meta)
    if validator is None:
        validator = _format._Validator(root, meta, version, all_files)
    return validator.index(doc)


def outcome(read: Any) -> tuple[Any, ...]:
    """("index", plain values) of ``read()``, or ("error", type, message) of what it raised."""
    try:
        return ("index", plain(read()))
    except Exception as e:  # compared, not hidden: both readers must fail alike
        return ("error", type(e).__name__, str(e))


def both_readers(root: str, raw: bytes) -> tuple[tuple[Any, ...] | None, tuple[Any, ...]]:
    """(the native reader's outcome, or None when it refuses the document; the Python
    validator's outcome) for the metadata bytes ``raw`` of checkpoint ``root``. Where the native
    reader accepts, the two outcomes must be equal (the data files on disk are checked by the
    same code either way, so a missing file fails both alike)."""
    from pyckpt import _format_read

    meta = f"{root}/{_format.METADATA_FILE}"
    x = _format_read._native(raw, meta, _format_read._check_seal(raw, meta))
    reference = outcome(lambda: python_index(root, raw))
    if x is None:
        return None, reference
    return outcome(lambda: _format._Validator(root, meta, x.version).from_native(x, raw)), reference
