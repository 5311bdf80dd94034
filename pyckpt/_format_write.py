"""On-disk format, the writing side: the metadata document of a save and its checksum seal.

Imported through :mod:`pyckpt._format`; ``docs/FORMAT.md`` is the specification.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyckpt import _C
from pyckpt._chunkindex import sweep_order
from pyckpt._format_spec import (
    _SEAL_HEAD,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_PLANNER_DEPTH,
    MEMORY_FORMATS,
    METADATA_FILE,
    PLACE_BOUND_VERSION,
    chunk_place_key,
    chunk_place_seed,
    codec_params_json,
)

if TYPE_CHECKING:
    from pyckpt._C import CodecParams

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# JSON helpers for DCP's planner_data (flatten mappings hold tuples of str/int).


def _tag(value: Any, depth: int = 0) -> Any:
    if depth > MAX_PLANNER_DEPTH:
        raise TypeError(f"planner_data is nested deeper than {MAX_PLANNER_DEPTH} levels")
    if isinstance(value, tuple):
        return {"__tuple__": [_tag(v, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_tag(v, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("planner_data dict keys must be str to be stored")
        if "__tuple__" in value:
            raise TypeError("planner_data dicts must not use the reserved key '__tuple__'")
        return {k: _tag(v, depth + 1) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise TypeError(f"planner_data holds the non-finite float {value!r}, which JSON lacks")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"planner_data value of type {type(value).__name__} is not storable")


def encode_planner_data(planner_data: Any) -> Any:
    """Encodes DCP planner_data as JSON; raises TypeError when it holds non-plain objects."""
    return _tag(planner_data)


def tensor_header(properties: Any, shape: Sequence[int]) -> dict[str, Any]:
    """The members of a tensor item every version shares, from DCP's ``TensorProperties``."""
    memory_format = str(properties.memory_format).removeprefix("torch.")
    return {
        "type": "tensor",
        "dtype": str(properties.dtype).removeprefix("torch."),
        "shape": list(shape),
        "requires_grad": bool(properties.requires_grad),
        "memory_format": memory_format if memory_format in MEMORY_FORMATS else
        "contiguous_format",
    }


def storable_planner_data(planner_data: Any) -> Any:
    """:func:`encode_planner_data`, or None (with a warning) when it cannot be stored."""
    try:
        return encode_planner_data(planner_data)
    except TypeError as e:
        logger.warning("pyckpt: planner_data not stored (%s)", e)
        return None


# ----------------------------------------------------------------------------------------------
# Writing


def _seal(body: bytes) -> bytes:
    """Appends the checksum member to the compact JSON ``body`` of a non-empty object."""
    if not (body.startswith(b"{") and body.endswith(b"}")) or body == b"{}":
        raise ValueError("the metadata document must be a non-empty JSON object")
    head = body[:-1]
    return head + _SEAL_HEAD + b"%016x" % _C.xxh64(head) + b'"}'


def encode_metadata(doc: Mapping[str, Any]) -> bytes:
    """Serialises a metadata document: compact JSON (UTF-8) ending in its checksum member.

    A document of ``version`` 1 is written as version 1 files were, without a checksum.
    """
    if "checksum" in doc:
        raise ValueError("the metadata document already has a checksum member")
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )
    return body if doc.get("version") == 1 else _seal(body)


def segments_to_json(
    segments: Iterable[tuple[str, int, CodecParams, Sequence[Sequence[Any]]]],
    seed: int | None = None,
) -> list[dict[str, Any]]:
    """Turns ``segment`` tuples with data-file *names* into their JSON form.

    With ``seed`` (the piece's :func:`chunk_place_seed`), each chunk's checksum is bound to its
    raw offset in the piece, as format version 3 stores it; without, it is stored as given.
    """
    out = []
    for name, raw_begin, params, chunks in segments:
        records = []
        pos = raw_begin
        for c in chunks:
            checksum = c[2] if seed is None else c[2] ^ chunk_place_key(seed, pos)
            records.append([c[0], c[1], checksum, c[3], list(c[4])])
            pos += c[1]
        out.append(
            {
                "file": name,
                "raw_begin": raw_begin,
                "codec": codec_params_json(params),
                "chunks": records,
            }
        )
    return out


def build_metadata(
    metadata: Any,
    segments: Mapping[Any, Sequence[Any]],
    files: Mapping[str, int],
    *,
    save_id: str,
    created_by: str,
) -> bytes:
    """Builds the metadata file of one save (what ``Writer.finish`` writes).

    Args:
        metadata: DCP's global ``Metadata`` of the save.
        segments: ``MetadataIndex`` (fqn, and offsets for a tensor piece) -> the ``segment``
            tuples written for it by every rank, with data-file *names*.
        files: every data file of the save -> its exact size.
        save_id: the save's id (:func:`new_save_id`).
        created_by: the writer's name and version.

    Returns:
        The bytes of ``pyckpt.json``.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            segs = sorted(segments.get(MetadataIndex(fqn), []), key=lambda s: s[1])
            items[fqn] = {
                "type": "bytes",
                "nbytes": sum(c[1] for s in segs for c in s[3]),
                "segments": segments_to_json(segs, chunk_place_seed(fqn)),
            }
            continue
        props = md.properties
        pieces = []
        # Sorted along the sweep dimension: readers index them without a sort (_chunkindex).
        for chunk in sweep_order(md.size, md.chunks):
            segs = sorted(segments.get(MetadataIndex(fqn, chunk.offsets), []), key=lambda s: s[1])
            pieces.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "segments": segments_to_json(segs, chunk_place_seed(fqn, chunk.offsets)),
                }
            )
        items[fqn] = {**tensor_header(props, md.size), "pieces": pieces}

    planner_data = storable_planner_data(metadata.planner_data)
    storage_meta = metadata.storage_meta
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_by": created_by,
        "save_id": save_id,
        "dcp_version": metadata.version,
        "storage_meta": {"modules": list(storage_meta.modules) if storage_meta else []},
        "planner_data": planner_data,
        "files": dict(files),
        "items": items,
    }
    return encode_metadata(doc)


def single_document(index: Any) -> bytes:
    """A version-3 ``pyckpt.json`` holding everything a fully read ``index`` (a
    ``CheckpointIndex`` of any version) says: what a staged copy of a sharded (version 4)
    checkpoint carries, so that a rank holding only some of its data files reads the chunk
    records of all. Each data file is recorded up to the end of its chunks (a version-4 file
    goes on with its shard, which the version-3 reader does not look at)."""
    ends: dict[str, int] = dict.fromkeys(index.files, 0)

    def segs(segments: Any, seed: int) -> list[dict[str, Any]]:
        named = []
        for path, raw_begin, params, chunks in segments:
            name = os.path.basename(path)
            for c in chunks:
                ends[name] = max(ends[name], c[0] + sum(c[4][1::2]))
            named.append((name, raw_begin, params, chunks))
        return segments_to_json(named, seed)

    items: dict[str, Any] = {}
    for fqn, t in index.tensors.items():
        items[fqn] = {
            "type": "tensor", "dtype": t.dtype, "shape": list(t.shape),
            "requires_grad": t.requires_grad, "memory_format": t.memory_format,
            "pieces": [{"offsets": list(p.offsets), "sizes": list(p.sizes),
                        "segments": segs(p.segments, chunk_place_seed(fqn, p.offsets))}
                       for p in sweep_order(t.shape, t.pieces)],
        }
    for fqn, b in index.bytes_items.items():
        items[fqn] = {"type": "bytes", "nbytes": b.nbytes,
                      "segments": segs(b.segments, chunk_place_seed(fqn))}
    doc = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "created_by": index.created_by,
        "save_id": index.save_id, "dcp_version": index.dcp_version,
        "storage_meta": {"modules": list(index.storage_meta.get("modules", []))},
        "planner_data": encode_planner_data(index.planner_data),
        "files": ends, "items": items,
    }
    return encode_metadata(doc)


def toggle_chunk_places(doc: dict[str, Any]) -> None:
    """XORs every chunk checksum of the metadata document ``doc`` (in place) with the key of
    its place (:func:`chunk_place_key`): binds the checksums of a document that holds plain
    XXH64s of the stored bytes, and unbinds those of a version-3 document. For repairs and
    tests; ``doc`` must have the documented structure (it is not validated)."""

    def walk(segments: list[dict[str, Any]], seed: int) -> None:
        for seg in segments:
            pos = seg["raw_begin"]
            for c in seg["chunks"]:
                c[2] ^= chunk_place_key(seed, pos)
                pos += c[1]

    for fqn, item in doc["items"].items():
        if item["type"] == "bytes":
            walk(item["segments"], chunk_place_seed(fqn))
        else:
            for piece in item["pieces"]:
                walk(piece["segments"], chunk_place_seed(fqn, piece["offsets"]))


def rewrite_metadata(
    path: str | os.PathLike[str],
    mutate: Callable[[dict[str, Any]], Any],
    *,
    rebind: bool = False,
) -> None:
    """Rewrites the metadata of checkpoint ``path`` through ``mutate``, re-computing its checksum.

    For repairs and tests: the document is parsed without validation (its checksum member
    dropped), passed to ``mutate`` (which edits it in place or returns a replacement dict) and
    written back with a fresh checksum (none for a version-1 document). Not atomic.

    With ``rebind``, ``mutate`` sees every chunk checksum as the plain XXH64 of the chunk's
    stored bytes, and the checksums are bound again to the places (and for the version) of the
    document it leaves: an edit that moves chunks, or changes the version, stays loadable.
    Without, chunk records are written exactly as ``mutate`` leaves them.
    """
    meta = os.path.join(os.fspath(path), METADATA_FILE)
    with open(meta, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("checksum", None)
    if rebind and doc.get("version", 0) >= PLACE_BOUND_VERSION:
        toggle_chunk_places(doc)
    new = mutate(doc)
    if isinstance(new, dict):
        doc = new
    if rebind and doc.get("version", 0) >= PLACE_BOUND_VERSION:
        toggle_chunk_places(doc)
    data = encode_metadata(doc)
    with open(meta, "wb") as f:
        f.write(data)

