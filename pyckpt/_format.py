"""On-disk format: the JSON metadata file, its validation, and the DCP ``Metadata`` it rebuilds.

See ``docs/FORMAT.md`` for the specification. This module is the one place that knows the
format: :func:`build_metadata` writes the metadata document and :func:`read_index` is the single
validation path every reader goes through (DCP ``Reader``, ``pyckpt.load``, the CLI tools and the
consolidator). It does no I/O of tensor data (that is the native core's job) and never unpickles
anything.

Layout of a checkpoint directory::

    pyckpt.json                      metadata, written last and atomically
    <rank>-<k>.<save_id>.pyckpt      data files (stored chunks back to back)

Python representations used across the package:

* ``params`` = a :class:`pyckpt._C.CodecParams` (validated when made: :func:`codec_params_for` on
  the write side, the metadata reader on the read side); stored in JSON as
  ``[codec, level, elem_size, transform]``, e.g. ``["zstd", 1, 2, "group_rotl1"]``.
* ``chunk`` = ``(file_offset, raw_len, checksum, transform_code, planes)`` where ``planes`` is a
  flat ``(mode0, len0, mode1, len1, ...)``; mode 0 = raw, 1 = zstd. In memory ``checksum`` is
  always the XXH64 of the stored bytes (what the native core verifies); in a version-3
  ``pyckpt.json`` it is stored bound to the chunk's place (:func:`chunk_place_key`), and
  :func:`build_metadata` / :func:`read_index` bind and unbind it.
* ``segment`` = ``(path, raw_begin, params, chunks)``: consecutive chunks of one piece stored in
  one file, covering the piece's raw bytes from ``raw_begin`` on.

This module is a facade: the format's code lives in :mod:`pyckpt._format_spec` (constants,
names, the index types), :mod:`pyckpt._format_write` (the metadata document of a save) and
:mod:`pyckpt._format_read` (opening ``pyckpt.json``, :func:`read_index`; the metadata reader
itself is native, ``csrc/core/pyckpt_index.hpp``). Import names from here.
"""

from __future__ import annotations

from pyckpt._format_read import (  # noqa: F401 (_open_metadata)
    DataFiles,
    _open_metadata,
    read_index,
    tensor_index,
    validate,
)
from pyckpt._format_spec import (
    CODEC_NONE,
    CODEC_ZSTD,
    CODECS,
    DTYPE_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_FILES,
    MAX_ITEM_BYTES,
    MAX_ITEMS,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    MAX_NUMEL,
    MAX_PIECES,
    MAX_PLANNER_DEPTH,
    MAX_SEGMENTS,
    MEMORY_FORMATS,
    METADATA_FILE,
    PLACE_BOUND_VERSION,
    RAW_CODEC_PARAMS,
    RAW_THRESHOLD,
    READABLE_VERSIONS,
    CheckpointIndex,
    StoredBytes,
    StoredPiece,
    StoredTensor,
    chunk_place_key,
    chunk_place_seed,
    codec_params_for,
    codec_params_json,
    data_file_name,
    data_file_rank,
    is_data_file,
    new_save_id,
)
from pyckpt._format_write import (
    build_metadata,
    encode_metadata,
    encode_planner_data,
    rewrite_metadata,
    segments_to_json,
    single_document,
    storable_planner_data,
    toggle_chunk_places,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "PLACE_BOUND_VERSION",
    "METADATA_FILE",
    "DTYPE_SIZES",
    "MEMORY_FORMATS",
    "MAX_METADATA_BYTES",
    "MAX_ITEMS",
    "MAX_FILES",
    "MAX_PIECES",
    "MAX_SEGMENTS",
    "MAX_CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_NDIM",
    "MAX_NUMEL",
    "MAX_ITEM_BYTES",
    "MAX_PLANNER_DEPTH",
    "StoredPiece",
    "StoredTensor",
    "StoredBytes",
    "CheckpointIndex",
    "RAW_THRESHOLD",
    "CODEC_NONE",
    "CODEC_ZSTD",
    "CODECS",
    "RAW_CODEC_PARAMS",
    "codec_params_for",
    "codec_params_json",
    "chunk_place_seed",
    "chunk_place_key",
    "new_save_id",
    "data_file_name",
    "is_data_file",
    "data_file_rank",
    "DataFiles",
    "read_index",
    "tensor_index",
    "validate",
    "build_metadata",
    "encode_metadata",
    "encode_planner_data",
    "rewrite_metadata",
    "storable_planner_data",
    "segments_to_json",
    "single_document",
    "toggle_chunk_places",
]
