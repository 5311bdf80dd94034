"""Consolidation, step 3: running a plan (temp files, stitching, commit).

Rank 0 (or, for node-local outputs, each writing rank) creates the temp files with their
headers and final sizes; every rank stitches its share natively; the files are fsynced, renamed
into place and the index is written last.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from pyckpt import _C, _gc, _paths, _progress
from pyckpt._consolidate.plan import INDEX_NAME, SINGLE_FILE, _byte_geometry, _OutFile, _Plan
from pyckpt._consolidate.scan import _Tensor
from pyckpt._paths import fsync_dir, fsync_file
from pyckpt.errors import PyckptError, UnsupportedDtypeError

__all__ = [
    "ProgressFn", "create_outputs", "remove_temps", "stitch_items", "run_share", "commit",
    "tensor_digest", "commit_files", "write_index", "prepare_index", "publish_index",
    "index_text", "stitch", "stale_outputs",
]

_TASK_BYTES = 16 << 20

#: Shard names of a Hugging Face export (``model-00002-of-00003.safetensors``): an earlier
#: export's shards that a later one into the same directory does not write are removed, as
#: ``transformers``' ``save_pretrained`` removes them.
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

ProgressFn = Callable[[int, int], None]


def create_outputs(plan: _Plan, dst: str, indices: Sequence[int] | None = None) -> None:
    """Creates the temp files (default: all) with their headers and final sizes, before any
    write (rank 0; with node-local outputs, each writing rank its own files)."""
    _paths.make_dir(dst, "the exported safetensors")
    _refuse_shadowing(plan, dst)
    created = []
    try:
        for f in _subset(plan, indices):
            path = os.path.join(dst, f.tmp)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            created.append(path)
            try:
                view = memoryview(f.header)
                while view:
                    view = view[os.write(fd, view) :]
                os.ftruncate(fd, f.size)
                if f.size > len(f.header):
                    # Reserve the blocks now: ENOSPC surfaces before any copy, and writes into
                    # allocated extents skip per-page delayed allocation (BENCHMARKS.md,
                    # "Small and medium exports").
                    os.posix_fallocate(fd, len(f.header), f.size - len(f.header))
            finally:
                os.close(fd)
    except BaseException:
        for path in created:
            _unlink_quiet(path)
        raise


def _listed(dst: str) -> set[str]:
    """The plain ``*.safetensors`` names the index in ``dst`` lists (an earlier export's
    files); empty when there is no readable index. Names with a path in them are ignored."""
    try:
        with open(os.path.join(dst, INDEX_NAME), "rb") as fh:
            weight_map = json.load(fh).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return set()
    if not isinstance(weight_map, dict):
        return set()
    return {v for v in weight_map.values()
            if isinstance(v, str) and v.endswith(".safetensors") and not v.startswith(".")
            and v == os.path.basename(v) and "/" not in v and "\0" not in v}


def stale_outputs(plan: _Plan, dst: str) -> list[str]:
    """Files of an earlier export in ``dst`` that this one does not write: those its index
    lists and any Hugging Face shard name. Left in place, readers that take every
    ``*.safetensors`` file of a directory would mix them with the new export."""
    new = {f.name for f in plan.files}
    listed = _listed(dst)
    try:
        with os.scandir(dst) as it:
            return sorted(e.name for e in it if e.name not in new
                          and (e.name in listed or _SHARD_NAME.fullmatch(e.name))
                          and not e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def _refuse_shadowing(plan: _Plan, dst: str) -> None:
    """``model.safetensors`` in ``dst`` that this export does not write and no export there
    listed (e.g. ``save_pretrained``'s): ``from_pretrained`` would load it, not the export."""
    path = os.path.join(dst, SINGLE_FILE)
    if (os.path.lexists(path) and all(f.name != SINGLE_FILE for f in plan.files)
            and SINGLE_FILE not in _listed(dst)):
        raise FileExistsError(
            errno.EEXIST,
            f"{dst} holds {SINGLE_FILE}, which is not part of an export there: transformers' "
            f"from_pretrained would load it instead of this export's {INDEX_NAME}; remove it or "
            "export into another directory", path)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _subset(plan: _Plan, indices: Sequence[int] | None) -> list[Any]:
    return list(plan.files) if indices is None else [plan.files[i] for i in indices]


def remove_temps(plan: _Plan, dst: str, indices: Sequence[int] | None = None) -> None:
    """Removes the temp files (default: all) and the index's temp file."""
    for f in _subset(plan, indices):
        _unlink_quiet(os.path.join(dst, f.tmp))
    _unlink_quiet(os.path.join(dst, plan.index_tmp))


#: One copy job of the native stitcher (``_C.stitch``): the elements ``[lo, hi)`` of a tensor's
#: output that a source block (a safetensors shard, or one pyckpt chunk) holds; the binding's
#: named tuple (fields documented in ``pyckpt/_C.pyi``).
StitchItem = _C.StitchItem


def is_chunk(item: StitchItem) -> bool:
    """A pyckpt chunk (``at`` is a ``_C.StitchChunk``), not a safetensors block."""
    return isinstance(item.at, tuple)


def stitch_items(plan: _Plan, dst: str, share: list[tuple[int, int, int]]) -> list[StitchItem]:
    """Turns this rank's byte ranges into stitcher items (one per overlapping shard)."""
    with _gc.paused():  # an item per chunk or shard, all kept (see pyckpt._gc)
        return _stitch_items(plan, dst, share)


def _stitch_items(plan: _Plan, dst: str, share: list[tuple[int, int, int]]) -> list[StitchItem]:
    items = []
    for file_index, lo, hi in share:
        f = plan.files[file_index]
        out_path = os.path.join(dst, f.tmp)
        for name, begin, end in f.tensors:
            a, b = max(lo, begin), min(hi, end)
            if a >= b:
                continue
            t = plan.tensors[name]
            cast = None if t.cast_to is None else _C.FloatCast(t.dtype, t.cast_to)
            whole = t.blocks[0].segments if cast is None and len(t.blocks) == 1 else None
            if whole is not None:
                # A pyckpt tensor stored whole (the common case): byte k of the piece is byte k
                # of the tensor, so each chunk's bytes are its place; no walk over dimensions.
                shape, offsets, sizes, _ = _byte_geometry(t, t.blocks[0])
                lo_b, hi_b, out_offset = a - begin, b - begin, f.data_start + begin
                for path, raw_begin, params, chunks in whole:
                    p = raw_begin
                    for rec in chunks:
                        q = p + rec[1]
                        if lo_b < q and p < hi_b:
                            items.append(StitchItem(name, shape, offsets, sizes, 1, path,
                                                    _C.StitchChunk(rec, params), out_path,
                                                    out_offset, lo_b, hi_b, p, q, None))
                        p = q
                continue
            for blk in t.blocks:
                shape, offsets, sizes, item = _byte_geometry(t, blk)
                out_item = item if cast is None else t.out_bits // 8  # output bytes per element
                if blk.segments is not None:
                    items.extend(
                        _chunk_items(
                            name, shape, offsets, sizes, blk.segments, out_path,
                            f.data_start + begin, (a - begin) // out_item,
                            (b - begin) // out_item, item, cast,
                        )
                    )
                    continue
                items.append(
                    StitchItem(
                        name, shape, offsets, sizes, item, blk.path, blk.offset, out_path,
                        f.data_start + begin, (a - begin) // out_item, (b - begin) // out_item,
                        0, 2**64 - 1, cast,
                    )
                )
    return items


def _chunk_items(
    name: str,
    shape: list[int],
    offsets: list[int],
    sizes: list[int],
    segments: tuple[Any, ...],
    out_path: str,
    out_offset: int,
    lo: int,
    hi: int,
    item: int = 1,
    cast: _C.FloatCast | None = None,
) -> list[StitchItem]:
    """Stitcher items (one per chunk) for the chunks of a pyckpt piece that reach [lo, hi).

    Byte geometry (item size 1): chunk ``[p, q)`` of the piece's raw bytes is block elements
    ``[p, q)``. With a ``cast``, the geometry is in elements of ``item`` bytes: chunk ``[p, q)``
    is block elements ``[p / item, q / item)``, so every chunk must hold whole elements (pyckpt
    writes chunks of a multiple of 4096 bytes, so its own checkpoints always do). A chunk whose first and last byte both land before ``lo`` or at/after ``hi`` of
    the tensor is left out (the stitcher would skip it anyway; this keeps the item list short
    when ranks split a large tensor).
    """
    strides = [1] * len(shape)
    for d in range(len(shape) - 1, 0, -1):
        strides[d - 1] = strides[d] * shape[d]

    def global_index(k: int) -> int:
        g = 0
        for d in range(len(sizes) - 1, -1, -1):
            k, r = divmod(k, sizes[d])
            g += (offsets[d] + r) * strides[d]
        return g

    items = []
    for path, raw_begin, params, chunks in segments:
        pos = raw_begin
        for rec in chunks:
            p, q = pos, pos + rec[1]
            pos = q
            if item != 1:
                if p % item or q % item:
                    raise UnsupportedDtypeError(
                        f"tensor {name!r} cannot be cast on export: its chunk at offset {rec[0]} "
                        f"of {path} holds raw bytes [{p}, {q}), not whole {item}-byte elements"
                    )
                p, q = p // item, q // item
            if p == q or global_index(q - 1) < lo or global_index(p) >= hi:
                continue
            items.append(
                StitchItem(name, shape, offsets, sizes, item, path, _C.StitchChunk(rec, params),
                           out_path, out_offset, lo, hi, p, q, cast)
            )
    return items


def run_share(
    plan: _Plan,
    dst: str,
    share: list[tuple[int, int, int]],
    threads: int,
    fsync: bool,
    progress: ProgressFn | None,
    input_mode: str = "pread",
) -> int:
    """Stitches this rank's byte ranges of the output files natively; returns the bytes copied."""
    items = stitch_items(plan, dst, share)
    total = sum(hi - lo for _, lo, hi in share)
    done_bytes = stitch([items], threads, fsync, progress, input_mode, total)
    if done_bytes != total:
        raise PyckptError(f"stitched {done_bytes} bytes, expected {total}")
    return total


def stitch(
    batches: Any,
    threads: int,
    fsync: bool,
    progress: ProgressFn | None,
    input_mode: str,
    total: int,
    partial: bool = False,
) -> int:
    """Runs ``_C.stitch`` on each list of items ``batches`` yields, reporting progress over all
    of them (``progress(0, total)`` first, ``progress(done, total)`` about every 0.1 s and at
    the end); returns the bytes stitched. Only the stitches are counted, not the native reads
    that produce the batches. ``partial``: a batch may supply only part of a tensor (the
    caller checks the total)."""
    if progress is not None:
        progress(0, total)
    done = 0
    with _progress.native_counter(progress, total, whole_block=False) as counting:
        for items in batches:
            if not items:
                continue
            with counting():
                stats = _C.stitch(items, threads, _TASK_BYTES, input_mode, fsync, partial=partial)
            done += int(stats["bytes"])
    if progress is not None and total == 0:  # native_counter reports nothing for an empty job
        progress(done, total)
    return done


def tensor_digest(t: _Tensor, scratch_dir: str, threads: int, input_mode: str = "pread") -> bytes:
    """BLAKE2b of a tensor's full row-major bytes as stored (before any cast).

    The tensor is stitched (decoded and checksum-verified, like an export) into a hidden scratch
    file in ``scratch_dir``, hashed and removed: the bytes of two tensors can then be compared
    whatever their sharding. Used for the few tied-weight candidates only.
    """
    whole = dataclasses.replace(t, cast_to=None)
    nbytes = whole.nbytes
    os.makedirs(scratch_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".pyckpt-tie-", suffix=".tmp", dir=scratch_dir)
    try:
        os.ftruncate(fd, nbytes)
        base = os.path.basename(path)
        out = _OutFile(base, base, b"", nbytes, 0, [(t.name, 0, nbytes)])
        plan = _Plan({t.name: whole}, [out], [[(0, 0, nbytes)]], index_tmp="")
        items = stitch_items(plan, scratch_dir, plan.shares[0])
        if items:
            _C.stitch(items, threads, _TASK_BYTES, input_mode, False)
        h = hashlib.blake2b(digest_size=32)
        pos = 0
        while pos < nbytes:
            block = os.pread(fd, min(_TASK_BYTES, nbytes - pos), pos)
            if not block:
                raise PyckptError(f"{path}: scratch file ended at {pos} of {nbytes} bytes")
            h.update(block)
            pos += len(block)
        return h.digest()
    finally:
        os.close(fd)
        _unlink_quiet(path)


def commit(plan: _Plan, dst: str, fsync: bool, index_ready: bool = False) -> list[str]:
    """fsyncs every file, withdraws an earlier export's index, renames the files into place,
    then writes the index last (rank 0): a crash leaves either no index or a complete export.
    ``index_ready``: :func:`prepare_index` already wrote it under ``plan.index_tmp`` (while the
    other ranks finished their shares); it is only renamed into place."""
    finals = commit_files(plan, dst, fsync)
    if index_ready:
        publish_index(dst, os.path.join(dst, plan.index_tmp), fsync)
    else:
        write_index(plan, dst, fsync)
    return finals


def commit_files(plan: _Plan, dst: str, fsync: bool, indices: Sequence[int] | None = None) -> list[str]:
    """fsyncs the files (default: all), withdraws an earlier export's index from ``dst``, then
    renames the files into place and removes that export's files this one does not write
    (:func:`stale_outputs`); returns the final paths."""
    finals = []
    files = _subset(plan, indices)
    for f in files:
        tmp = os.path.join(dst, f.tmp)
        if fsync:
            fsync_file(tmp)
    stale = stale_outputs(plan, dst)  # before the index that lists them is withdrawn
    # An earlier export's index would name a mix of old and new shards while they are swapped:
    # withdraw it first, so the directory looks incomplete until the new index lands.
    old_index = os.path.join(dst, INDEX_NAME)
    if os.path.lexists(old_index):
        os.unlink(old_index)
        if fsync:
            fsync_dir(dst)
    for f in files:
        final = os.path.join(dst, f.name)
        os.replace(os.path.join(dst, f.tmp), final)
        finals.append(final)
    for name in stale:  # no index names them now; the new one (published next) will not
        _unlink_quiet(os.path.join(dst, name))
    return finals


def index_text(metadata: dict[str, Any], weight_map: dict[str, str]) -> str:
    """``json.dumps({"metadata": ..., "weight_map": ...}, indent=2, sort_keys=True)``, the same
    text, with the weight map's lines made by the C string encoder (``json.dumps`` with an
    indent encodes in pure Python: a tenth of a millisecond for a small export's index)."""
    if not weight_map:
        return json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2,
                          sort_keys=True)
    enc = json.encoder.encode_basestring_ascii  # what json.dumps uses (ensure_ascii)
    meta = json.dumps(metadata, indent=2, sort_keys=True).replace("\n", "\n  ")
    lines = ",\n".join(f"    {enc(k)}: {enc(v)}" for k, v in sorted(weight_map.items()))
    return f'{{\n  "metadata": {meta},\n  "weight_map": {{\n{lines}\n  }}\n}}'


def write_index(plan: _Plan, dst: str, fsync: bool) -> None:
    """Writes ``model.safetensors.index.json`` atomically (the last step of an export)."""
    # One temp name per process: node-local ranks that share ``dst`` all write the same index.
    tmp = prepare_index(plan, dst, fsync, f"{plan.index_tmp}.{os.getpid()}")
    try:
        publish_index(dst, tmp, fsync)
    except BaseException:
        _unlink_quiet(tmp)
        raise


def prepare_index(plan: _Plan, dst: str, fsync: bool, name: str | None = None) -> str:
    """Writes the index under a temp name in ``dst`` (default ``plan.index_tmp``), fsynced when
    ``fsync``; returns its path. Nothing is left behind on failure."""
    metadata: dict[str, Any] = {"total_size": plan.total_bytes}
    if plan.ties:  # written once: the index records which name each left-out copy equals
        metadata["tied_weights"] = dict(sorted(plan.ties.items()))
    weight_map = {n: f.name for f in plan.files for n, _, _ in f.tensors}
    tmp = os.path.join(dst, plan.index_tmp if name is None else name)
    # Encoded once and written with plain os calls (no buffered text file for a few kilobytes).
    data = memoryview((index_text(metadata, weight_map) + "\n").encode("utf-8"))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            while data:
                data = data[os.write(fd, data) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return tmp


def publish_index(dst: str, tmp: str, fsync: bool) -> None:
    """Renames the index written by :func:`prepare_index` into place (the export's last step)."""
    os.replace(tmp, os.path.join(dst, INDEX_NAME))
    if fsync:
        fsync_dir(dst)
