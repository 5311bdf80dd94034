"""Export a sharded checkpoint to standard Hugging Face safetensors files, spread over ranks.

See :func:`consolidate` and ``docs/CONSOLIDATE.md``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from pyckpt import _C, _knobs
from pyckpt._partition import partition
from pyckpt.errors import CheckpointFormatError, PyckptError, UnsupportedDtypeError

__all__ = ["consolidate", "ConsolidationResult", "INDEX_NAME"]

logger = logging.getLogger(__name__)

#: Name of the Hugging Face index written next to the output files.
INDEX_NAME = "model.safetensors.index.json"
_SHARDING_KEY = "DCP_SHARDING_INFO"
_TASK_BYTES = 16 << 20

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class _Block:
    """Row-major bytes of one shard: ``path`` at absolute ``offset``, hyper-rectangle geometry.

    For a pyckpt piece, ``segments`` holds its stored segments (``_format`` tuples) and the bytes
    come from decoding their chunks; ``path`` is then the first segment's file (for messages).
    """

    path: str
    offset: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    segments: tuple[Any, ...] | None = None


@dataclass
class _Tensor:
    name: str
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    bits: int
    blocks: list[_Block] = field(default_factory=list)
    encoded: bool = False  # pyckpt input: blocks are decoded from chunks, stitched as bytes

    @property
    def nbytes(self) -> int:
        n = self.bits
        for d in self.shape:
            n *= d
        return n // 8


@dataclass
class _OutFile:
    name: str  # final basename
    tmp: str  # temp basename
    header: bytes
    size: int
    data_start: int
    tensors: list[tuple[str, int, int]]  # (name, begin, end) relative to the data section


@dataclass
class _Plan:
    tensors: dict[str, _Tensor]
    files: list[_OutFile]
    shares: list[list[tuple[int, int, int]]]  # per rank: (file index, lo, hi) of data sections
    index_tmp: str

    @property
    def total_bytes(self) -> int:
        return sum(f.size - f.data_start for f in self.files)


@dataclass(frozen=True)
class ConsolidationResult:
    """What :func:`consolidate` did (the same on every rank except ``rank_bytes``/``seconds``).

    Attributes:
        files: final paths of the safetensors files written, in index order.
        index_path: path of ``model.safetensors.index.json``.
        total_bytes: tensor data bytes over all files (the index's ``metadata.total_size``).
        rank_bytes: tensor data bytes this rank copied.
        seconds: wall time of the call on this rank.
    """

    files: list[str]
    index_path: str
    total_bytes: int
    rank_bytes: int
    seconds: float


# --------------------------------------------------------------------------- input scanning


def _int_tuple(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CheckpointFormatError(f"{what} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _scan_safetensors(src: str) -> dict[str, _Tensor]:
    """Reads every ``*.safetensors`` header in ``src`` and groups the shards by tensor."""
    names = sorted(
        n for n in os.listdir(src) if n.endswith(".safetensors") and not n.startswith(".")
    )
    if not names:
        if os.path.isfile(os.path.join(src, ".metadata")):
            raise CheckpointFormatError(
                f"{src}: a DCP FileSystemWriter checkpoint (.metadata, no pyckpt.json) cannot be "
                "consolidated directly; convert it first with `pyckpt convert SRC PYCKPT_DIR` "
                "(pyckpt.tools.convert), then consolidate that"
            )
        raise CheckpointFormatError(f"{src}: no *.safetensors files to consolidate")
    tensors: dict[str, _Tensor] = {}
    origin: dict[str, str] = {}
    for fname in names:
        path = os.path.join(src, fname)
        # Shards are plain files inside src: a symlink could point anywhere (another user's
        # file, a device), so it is refused before anything is opened.
        if os.path.islink(path) or not os.path.isfile(path):
            raise CheckpointFormatError(
                f"{path}: input shards must be regular files inside {src} (symlinks and other "
                "file types are refused)"
            )
        header = _C.read_safetensors_header(path)
        sharding = None
        raw = cast("dict[str, str]", header["metadata"]).get(_SHARDING_KEY)
        if raw is not None:
            try:
                sharding = json.loads(raw)
            except ValueError as e:
                raise CheckpointFormatError(f"{path}: {_SHARDING_KEY} is not valid JSON: {e}") from None
            if not isinstance(sharding, dict):
                raise CheckpointFormatError(f"{path}: {_SHARDING_KEY} is not a JSON object")
        for name, dtype, shape, begin, _end in cast("list[Any]", header["tensors"]):
            if sharding is None:
                offsets = (0,) * len(shape)
            else:
                entry = sharding.get(name)
                if not isinstance(entry, dict) or "saved_offsets" not in entry:
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} has no saved_offsets in {_SHARDING_KEY}"
                    )
                offsets = _int_tuple(entry["saved_offsets"], f"{path}: saved_offsets of {name!r}")
                if len(offsets) != len(shape):
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} has shape {list(shape)} but saved_offsets "
                        f"{list(offsets)}"
                    )
            t = tensors.get(name)
            if t is None:
                t = tensors[name] = _Tensor(
                    name, dtype, (), _C.safetensors_dtype_bits(dtype)
                )
                origin[name] = fname
            elif t.dtype != dtype:
                raise CheckpointFormatError(
                    f"tensor {name!r} is {t.dtype} in {origin[name]} but {dtype} in {fname}"
                )
            elif len(t.blocks[0].sizes) != len(shape):
                raise CheckpointFormatError(
                    f"tensor {name!r} has rank {len(t.blocks[0].sizes)} in {origin[name]} "
                    f"but rank {len(shape)} in {fname}"
                )
            t.blocks.append(_Block(path, header["data_start"] + begin, offsets, tuple(shape)))
    for t in tensors.values():
        ndim = len(t.blocks[0].sizes)
        t.shape = tuple(max(b.offsets[d] + b.sizes[d] for b in t.blocks) for d in range(ndim))
        _C.check_tiling(
            t.name,
            list(t.shape),
            [(list(b.offsets), list(b.sizes), os.path.basename(b.path)) for b in t.blocks],
        )
    return tensors


#: pyckpt dtype (torch name) -> safetensors dtype. Absent: no safetensors spelling exists
#: (complex128, complex32), refused with UnsupportedDtypeError.
_ST_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


def _is_pyckpt(src: str) -> bool:
    from pyckpt._format import METADATA_FILE

    return os.path.isfile(os.path.join(src, METADATA_FILE))


def _scan_pyckpt(src: str) -> dict[str, _Tensor]:
    """Reads a pyckpt checkpoint's metadata; every stored tensor becomes a _Tensor of pieces."""
    from pyckpt._format import DTYPE_SIZES, read_index

    index = read_index(src)
    if index.bytes_items:
        logger.info(
            "%s: skipping %d non-tensor item(s) (DCP BYTE_IO values have no safetensors form)",
            src, len(index.bytes_items),
        )
    if not index.tensors:
        raise CheckpointFormatError(f"{src}: the checkpoint holds no tensors to consolidate")
    tensors: dict[str, _Tensor] = {}
    for name in sorted(index.tensors):
        st = index.tensors[name]
        dtype = _ST_DTYPES.get(st.dtype)
        if dtype is None:
            raise UnsupportedDtypeError(
                f"tensor {name!r} has dtype {st.dtype}, which safetensors cannot represent"
            )
        bits = _C.safetensors_dtype_bits(dtype)
        if bits != 8 * DTYPE_SIZES[st.dtype]:  # the two tables must agree
            raise PyckptError(f"dtype tables disagree on {st.dtype} / {dtype}")
        t = tensors[name] = _Tensor(name, dtype, tuple(st.shape), bits, encoded=True)
        for piece in st.pieces:
            segs = tuple(piece.segments)
            origin = os.path.join(src, "<no data>") if not segs else segs[0][0]
            t.blocks.append(_Block(origin, 0, tuple(piece.offsets), tuple(piece.sizes), segs))
        _C.check_tiling(
            name, list(t.shape),
            [(list(b.offsets), list(b.sizes), os.path.basename(b.path)) for b in t.blocks],
        )
    return tensors


# --------------------------------------------------------------------------- planning


def _hf_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _assign_files(
    tensors: dict[str, _Tensor],
    fqn_to_file: Mapping[str, int | str] | None,
    max_file_bytes: int | None,
) -> dict[str, list[str]]:
    """Maps output file name -> tensor names (sorted), in output order."""
    names = sorted(tensors)
    groups: dict[str, list[str]] = {}
    if fqn_to_file is not None:
        missing = [n for n in names if n not in fqn_to_file]
        if missing:
            raise ValueError(f"fqn_to_file has no entry for {missing[:5]} ({len(missing)} in all)")
        unknown = sorted(set(fqn_to_file) - set(names))
        if unknown:
            raise ValueError(f"fqn_to_file names tensors not in the checkpoint: {unknown[:5]}")
        ints = [v for v in fqn_to_file.values() if isinstance(v, int) and not isinstance(v, bool)]
        count = max(ints) if ints else 0
        for n in names:
            v = fqn_to_file[n]
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ValueError(f"fqn_to_file[{n!r}] must be an int index or a file name")
            if isinstance(v, int):
                if v < 1:
                    raise ValueError(f"fqn_to_file[{n!r}] = {v}: indices start at 1")
                fname = _hf_name(v, count)
            else:
                if (
                    "/" in v or os.sep in v or "\0" in v or v != os.path.basename(v)
                    or not v.endswith(".safetensors") or v.startswith(".")
                ):
                    raise ValueError(f"fqn_to_file[{n!r}] = {v!r} is not a *.safetensors basename")
                fname = v
            groups.setdefault(fname, []).append(n)
        return dict(sorted(groups.items()))
    if max_file_bytes is not None and max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    buckets: list[list[str]] = [[]]
    used = 0
    for n in names:
        size = tensors[n].nbytes
        if max_file_bytes is not None and buckets[-1] and used + size > max_file_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(n)
        used += size
    return {_hf_name(i + 1, len(buckets)): b for i, b in enumerate(buckets)}


def _byte_geometry(t: _Tensor, b: _Block) -> tuple[list[int], list[int], list[int], int]:
    """(shape, offsets, sizes, item_bytes) in whole elements of >= 1 byte.

    Sub-byte dtypes (F4, F6_*) are stitched as bytes: the last dimension is rescaled, which needs
    every shard boundary along it to fall on a byte boundary. pyckpt pieces are always stitched
    as bytes (last dimension times the element size, a scalar as a vector of its bytes): their
    chunks are byte ranges that may start or end inside an element.
    """
    if t.encoded:
        item = t.bits // 8
        if not t.shape:
            return [item], [0], [item], 1
        last = len(t.shape) - 1
        return (
            list(t.shape[:last]) + [t.shape[last] * item],
            list(b.offsets[:last]) + [b.offsets[last] * item],
            list(b.sizes[:last]) + [b.sizes[last] * item],
            1,
        )
    if t.bits % 8 == 0:
        return list(t.shape), list(b.offsets), list(b.sizes), t.bits // 8
    if len(t.blocks) == 1:  # the whole tensor in one shard: a plain byte vector
        return [t.nbytes], [0], [t.nbytes], 1
    last = len(t.shape) - 1
    for v in (t.shape[last], b.offsets[last], b.sizes[last]):
        if (v * t.bits) % 8:
            raise UnsupportedDtypeError(
                f"tensor {t.name!r} ({t.dtype}, {t.bits}-bit elements) is sharded at an element "
                "boundary that is not a byte boundary; it cannot be stitched"
            )
    scale = lambda v: v * t.bits // 8  # noqa: E731
    shape = list(t.shape[:last]) + [scale(t.shape[last])]
    offsets = list(b.offsets[:last]) + [scale(b.offsets[last])]
    sizes = list(b.sizes[:last]) + [scale(b.sizes[last])]
    return shape, offsets, sizes, 1


def _make_plan(
    src: str,
    nranks: int,
    fqn_to_file: Mapping[str, int | str] | None,
    max_file_bytes: int | None,
) -> _Plan:
    tensors = _scan_pyckpt(src) if _is_pyckpt(src) else _scan_safetensors(src)
    groups = _assign_files(tensors, fqn_to_file, max_file_bytes)
    token = uuid.uuid4().hex[:12]
    files: list[_OutFile] = []
    for fname, members in groups.items():
        header, layout, data_bytes = _C.safetensors_header(
            [(n, tensors[n].dtype, list(tensors[n].shape)) for n in members], [("format", "pt")]
        )
        files.append(
            _OutFile(
                name=fname,
                tmp=f".{fname}.tmp-{token}",
                header=header,
                size=len(header) + data_bytes,
                data_start=len(header),
                tensors=[(n, b, e) for n, b, e in layout],
            )
        )
    work = [
        [(e - b, max(1, tensors[n].bits // 8) if tensors[n].bits % 8 == 0 else 1)
         for n, b, e in f.tensors]
        for f in files
    ]
    shares = partition(work, nranks)
    return _Plan(tensors, files, shares, index_tmp=f".{INDEX_NAME}.tmp-{token}")


# --------------------------------------------------------------------------- writing


def _create_outputs(plan: _Plan, dst: str) -> None:
    """Creates every temp file with its header and its final size (rank 0, before any write)."""
    os.makedirs(dst, exist_ok=True)
    created = []
    try:
        for f in plan.files:
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
                    # allocated extents skip per-page delayed allocation (measured ~1.5x faster).
                    os.posix_fallocate(fd, len(f.header), f.size - len(f.header))
            finally:
                os.close(fd)
    except BaseException:
        for path in created:
            _unlink_quiet(path)
        raise


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_temps(plan: _Plan, dst: str) -> None:
    for f in plan.files:
        _unlink_quiet(os.path.join(dst, f.tmp))
    _unlink_quiet(os.path.join(dst, plan.index_tmp))


def _items(plan: _Plan, dst: str, share: list[tuple[int, int, int]]) -> list[tuple]:
    """Turns this rank's byte ranges into stitcher items (one per overlapping shard)."""
    items = []
    for file_index, lo, hi in share:
        f = plan.files[file_index]
        out_path = os.path.join(dst, f.tmp)
        for name, begin, end in f.tensors:
            a, b = max(lo, begin), min(hi, end)
            if a >= b:
                continue
            t = plan.tensors[name]
            for blk in t.blocks:
                shape, offsets, sizes, item = _byte_geometry(t, blk)
                if blk.segments is not None:
                    items.extend(
                        _chunk_items(
                            name, shape, offsets, sizes, blk.segments, out_path,
                            f.data_start + begin, a - begin, b - begin,
                        )
                    )
                    continue
                items.append(
                    (
                        name, shape, offsets, sizes, item, blk.path, blk.offset, out_path,
                        f.data_start + begin, (a - begin) // item, (b - begin) // item,
                        0, 2**64 - 1,
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
) -> list[tuple]:
    """Stitcher items (one per chunk) for the chunks of a pyckpt piece that reach [lo, hi).

    Byte geometry (item size 1): chunk ``[p, q)`` of the piece's raw bytes is block elements
    ``[p, q)``. A chunk whose first and last byte both land before ``lo`` or at/after ``hi`` of
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
            if p == q or global_index(q - 1) < lo or global_index(p) >= hi:
                continue
            items.append(
                (name, shape, offsets, sizes, 1, path, (rec, params), out_path, out_offset,
                 lo, hi, p, q)
            )
    return items


def _run_share(
    plan: _Plan,
    dst: str,
    share: list[tuple[int, int, int]],
    threads: int,
    fsync: bool,
    progress: ProgressFn | None,
) -> int:
    items = _items(plan, dst, share)
    total = sum(hi - lo for _, lo, hi in share)
    counter = _C.StitchProgress()
    done = threading.Event()
    poller = None
    if progress is not None:
        progress(0, total)

        def poll() -> None:
            while not done.wait(0.1):
                progress(counter.bytes, total)

        poller = threading.Thread(target=poll, name="pyckpt-consolidate-progress", daemon=True)
        poller.start()
    try:
        stats = _C.stitch(
            items, threads, _TASK_BYTES, _knobs.consolidate_input(), fsync, counter
        )
    finally:
        done.set()
        if poller is not None:
            poller.join()
    if progress is not None:
        progress(counter.bytes, total)
    if stats["bytes"] != total:
        raise PyckptError(f"stitched {stats['bytes']} bytes, expected {total}")
    return total


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(plan: _Plan, dst: str, fsync: bool) -> list[str]:
    """fsyncs every file, withdraws an earlier export's index, renames the files into place,
    then writes the index last (rank 0): a crash leaves either no index or a complete export."""
    finals = []
    for f in plan.files:
        tmp = os.path.join(dst, f.tmp)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    # An earlier export's index would name a mix of old and new shards while they are swapped:
    # withdraw it first, so the directory looks incomplete until the new index lands.
    old_index = os.path.join(dst, INDEX_NAME)
    if os.path.lexists(old_index):
        os.unlink(old_index)
        if fsync:
            _fsync_dir(dst)
    for f in plan.files:
        final = os.path.join(dst, f.name)
        os.replace(os.path.join(dst, f.tmp), final)
        finals.append(final)
    index = {
        "metadata": {"total_size": plan.total_bytes},
        "weight_map": {n: f.name for f in plan.files for n, _, _ in f.tensors},
    }
    tmp = os.path.join(dst, plan.index_tmp)
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(index, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(dst, INDEX_NAME))
    if fsync:
        _fsync_dir(dst)
    return finals


# --------------------------------------------------------------------------- collectives


def _group_info(process_group: Any) -> tuple[int, int, bool]:
    try:
        import torch.distributed as dist
    except ImportError:  # torch is optional: a single process then
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is unavailable") from None
        return 0, 1, False
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return 0, 1, False
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    return rank, dist.get_world_size(process_group), True


def _broadcast(obj: Any, group: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _all_gather(obj: Any, group: Any, world: int) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a PyckptError with its message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return PyckptError(f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- public API


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    process_group: Any = None,
    fqn_to_file: Mapping[str, int | str] | None = None,
    max_file_bytes: int | None = None,
    threads: int | None = None,
    fsync: bool | None = None,
    progress: ProgressFn | None = None,
) -> ConsolidationResult:
    """Writes the full tensors of a sharded checkpoint as standard Hugging Face safetensors files.

    Accepted input (``src``, a directory):

    * a pyckpt checkpoint (the directory holds ``pyckpt.json``; written by
      ``dcp.save(sd, storage_writer=pyckpt.Writer(src, compression=None | "zstd"))``): its
      chunks are read, checksum-verified and decoded natively on the way, one chunk at a time
      per copy thread. Every pyckpt dtype with a safetensors spelling is accepted (all but
      complex128 and complex32); non-tensor items (DCP ``BYTE_IO`` values such as a step
      counter) have no safetensors form and are skipped;
    * the ``*.safetensors`` files written by DCP's
      ``HuggingFaceStorageWriter(save_distributed=True)`` (each file's ``__metadata__`` carries
      ``DCP_SHARDING_INFO`` with every shard's ``saved_offsets``), and plain safetensors files
      without that key (each tensor then is whole, at offset 0). Every file header is validated
      strictly; all safetensors dtypes are accepted.

    Either way: any tensor rank, shards (DTensor pieces) along any dimension or several, of
    uneven sizes.

    Output (``dst``, created if needed): ``model-0000i-of-0000N.safetensors`` files (8-byte
    aligned header padded with spaces, ``__metadata__ = {"format": "pt"}``, tensors contiguous
    and sorted by name) and ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``). Each file is written under a hidden temp name and renamed only once every
    rank has finished it; the index is renamed last. A failure or a crash never leaves a
    partial file under a final name (a killed run can leave ``.*.tmp-*`` files behind).

    Every rank of ``process_group`` must call this with the same arguments; each copies a share
    of the output balanced by bytes (whole files when that balances within 5%, else byte ranges
    that may split a file or a tensor). Rank 0 reads the headers or metadata, plans, creates
    and sizes the temp files; all ranks write their ranges (native threads, GIL released, memory
    bounded by ``threads`` x 2 x 16 MiB, or ``threads`` x 2 chunks for pyckpt inputs); rank 0
    fsyncs, renames and writes the index. Processes outside the group must not call it. After ``dcp.async_save``, wait for the returned future
    (``fut.result()``) on every rank before consolidating its output.

    Args:
        src: input directory.
        dst: output directory (may equal ``src``'s parent; must not be ``src`` itself if the
            output names could collide with the inputs).
        process_group: the ranks that share the work; default: the default group when
            ``torch.distributed`` is initialised, else this process alone.
        fqn_to_file: tensor name -> output file, either a 1-based index (files named
            ``model-<i>-of-<max>.safetensors``) or an explicit ``*.safetensors`` basename.
            Must name every tensor.
        max_file_bytes: without ``fqn_to_file``, start a new output file (in name order) before
            a tensor that would push the current one past this many data bytes. Default: one file.
        threads: native copy threads per rank (default ``PYCKPT_NUM_THREADS``).
        fsync: fsync outputs before renaming (default ``PYCKPT_FSYNC``, on).
        progress: called on this rank as ``progress(bytes_done, bytes_total)`` about every 0.1 s
            from a helper thread while copying.

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        CheckpointFormatError: malformed or inconsistent input (bad header or metadata, offsets
            beyond a file, overlapping shards, a missing shard, mismatched dtypes or ranks);
            names the tensor and file.
        ChecksumError: a pyckpt chunk does not match its recorded checksum (names the tensor,
            the data file and the chunk's offset); no output file is left behind.
        CompressionError: a pyckpt chunk's zstd frame does not decode.
        UnsupportedDtypeError: a pyckpt tensor whose dtype safetensors cannot represent (names
            the tensor), or a sub-byte dtype sharded at a non-byte boundary.
        FileNotFoundError / OSError: I/O failures, with the file name.
        ValueError: bad arguments.
    """
    start = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    from pyckpt import _objstore

    if _objstore.is_url(src) or _objstore.is_url(dst):  # staged through local temp files
        return cast(ConsolidationResult, _objstore.consolidate_staged(
            consolidate, src, dst, process_group=process_group, fqn_to_file=fqn_to_file,
            max_file_bytes=max_file_bytes, threads=threads, fsync=fsync, progress=progress))
    rank, world, distributed = _group_info(process_group)
    nthreads = _knobs.num_threads() if threads is None else int(threads)
    if nthreads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    do_fsync = _knobs.fsync() if fsync is None else bool(fsync)

    plan: _Plan | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            plan = _make_plan(src, world, fqn_to_file, max_file_bytes)
            _create_outputs(plan, dst)
        except Exception as e:
            error = e
    if distributed:
        plan, remote = _broadcast((plan, None if error is None else _portable(error)), process_group)
        if error is None and remote is not None:
            raise remote
    if error is not None:
        raise error
    assert plan is not None

    local_error: BaseException | None = None
    rank_bytes = 0
    try:
        rank_bytes = _run_share(plan, dst, plan.shares[rank], nthreads, do_fsync, progress)
    except Exception as e:
        local_error = e
    if distributed:
        statuses = _all_gather(
            None if local_error is None else _portable(local_error), process_group, world
        )
    else:
        statuses = [local_error]
    failed = [(r, e) for r, e in enumerate(statuses) if e is not None]
    if failed:
        if rank == 0:
            _remove_temps(plan, dst)
        if local_error is not None:
            raise local_error
        bad_rank, err = failed[0]
        raise PyckptError(
            f"consolidation failed on rank {bad_rank}: {type(err).__name__}: {err}"
        ) from err

    finals: list[str] = []
    commit_error: BaseException | None = None
    if rank == 0:
        try:
            finals = _commit(plan, dst, do_fsync)
        except Exception as e:
            commit_error = e
            _remove_temps(plan, dst)
    if distributed:
        remote = _broadcast(None if commit_error is None else _portable(commit_error), process_group)
        if commit_error is None and remote is not None:
            raise PyckptError(f"consolidation failed on rank 0: {remote}") from remote
    if commit_error is not None:
        raise commit_error
    if rank != 0:
        finals = [os.path.join(dst, f.name) for f in plan.files]
    seconds = time.perf_counter() - start
    logger.info(
        "rank %d/%d consolidated %d of %d bytes into %d file(s) in %.3f s",
        rank, world, rank_bytes, plan.total_bytes, len(plan.files), seconds,
    )
    return ConsolidationResult(
        files=finals,
        index_path=os.path.join(dst, INDEX_NAME),
        total_bytes=plan.total_bytes,
        rank_bytes=rank_bytes,
        seconds=seconds,
    )
