"""The metadata reader (``_C.parse_pyckpt_index``) against the Python validator kept as its
oracle (tests/_index_oracle.py): both read the same bytes, and must accept the same documents,
build the same index (every field, the order of tensors, bytes items and pieces, each segment's
path, codec fields and chunk records) and refuse the others with the same error and message."""

from __future__ import annotations

import re
from typing import Any

from _index_oracle import oracle_index

from pyckpt import _C, _format


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


class _Names(_format.DataFiles):
    """Data files not looked at: each one's path is its name (as the oracle's)."""

    def __init__(self, meta: str) -> None:
        super().__init__("", meta)

    def check_file(self, name: str, size: int) -> str:
        return name


# The reader itself, taken before the suite's conftest wraps it (or a test records its calls).
_PARSE = _C.parse_pyckpt_index


def parse(raw: bytes, meta: str, **options: Any) -> Any:
    """``_C.parse_pyckpt_index`` itself (not the suite's checked wrapper, see conftest)."""
    return _PARSE(raw, meta, **options)


def native_index(raw: bytes, meta: str, **options: Any) -> _format.CheckpointIndex:
    """The metadata reader's index of ``raw`` (data files not looked at, paths their names)."""
    return _Names(meta).index(parse(raw, meta, **options))


def outcome(read: Any) -> tuple[Any, ...]:
    """("index", plain values) of ``read()``, or ("error", type, message) of what it raised.
    The JSON parser's own wording after "not valid JSON" is left out (Python's json module and
    the reader word syntax errors alike, not always to the character)."""
    try:
        return ("index", plain(read()))
    except Exception as e:  # compared, not hidden: both readers must fail alike
        message = re.sub(r"not valid JSON \(.*", "not valid JSON (...)", str(e), flags=re.S)
        return ("error", type(e).__name__, message)


def both_readers(raw: bytes, meta: str = "/ck/pyckpt.json",
                 **options: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(the metadata reader's outcome, the oracle's outcome) for the metadata bytes ``raw``;
    they must be equal."""
    return (outcome(lambda: native_index(raw, meta, **options)),
            outcome(lambda: oracle_index(raw, meta, **options)))
