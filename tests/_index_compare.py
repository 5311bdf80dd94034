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


def python_index(root: str, raw: bytes, *, all_files: bool = True) -> _format.CheckpointIndex:
    """The Python validator's index of the metadata bytes ``raw`` of checkpoint ``root``."""
    from pyckpt import _format_read

    meta = f"{root}/{_format.METADATA_FILE}"
    doc, version = _format_read._parse([raw], meta)
    return _format._Validator(root, meta, version, all_files).index(doc)
