"""Consolidation, step 2: planning the output from the scanned tensors.

Output files (which tensors go where, by ``fqn_to_file`` or ``max_file_bytes``), their headers
and sizes, each rank's byte share (:mod:`pyckpt._partition`), and the byte geometry the stitcher
uses for each block.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _C
from pyckpt._consolidate.scan import ScannedTensors, _Block, _Tensor
from pyckpt._partition import partition
from pyckpt.errors import UnsupportedDtypeError

__all__ = ["INDEX_NAME", "SINGLE_FILE", "make_plan"]

#: Name of the Hugging Face index written next to the output files.
INDEX_NAME = "model.safetensors.index.json"

#: The single-file name, which ``from_pretrained`` loads in preference to the index.
SINGLE_FILE = "model.safetensors"


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
    writers: list[int] = field(default_factory=list)  # per file: its writing rank (whole_files)
    ties: dict[str, str] = field(default_factory=dict)  # tied weight left out -> the copy written

    @property
    def total_bytes(self) -> int:
        return sum(f.size - f.data_start for f in self.files)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles what the other ranks need: a plan is pickled only when rank 0 sends it to them
        (``agree(ranks="root")`` hands rank 0 its own object), and a rank reads ``tensors`` only
        for the names in its share. So the tensors of no other rank's share are left out, and
        the rest travel as plain tuples: at thousands of tensors, pickling dataclasses per tensor
        and piece was a good part of the export's planning, and unpickling them the other ranks'
        wait."""
        needed = {name for share in self.shares[1:] for file_index, lo, hi in share
                  for name, begin, end in self.files[file_index].tensors
                  if max(lo, begin) < min(hi, end)}
        tensors = [(t.name, t.dtype, t.shape, t.bits, [tuple(b) for b in t.blocks], t.encoded,
                    t.cast_to, t.unsupported)
                   for name, t in self.tensors.items() if name in needed]
        return _unpickle_plan, (tensors, self.files, self.shares, self.index_tmp, self.writers,
                                self.ties)


def _unpickle_plan(tensors: list[tuple[Any, ...]], files: list[_OutFile],
                   shares: list[list[tuple[int, int, int]]], index_tmp: str, writers: list[int],
                   ties: dict[str, str]) -> _Plan:
    table = {t[0]: _Tensor(t[0], t[1], t[2], t[3], [_Block._make(b) for b in t[4]], *t[5:])
             for t in tensors}
    return _Plan(table, files, shares, index_tmp, writers, ties)



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
        if SINGLE_FILE in groups and len(groups) > 1:
            raise ValueError(
                f"fqn_to_file names {SINGLE_FILE} as one of {len(groups)} files: transformers' "
                f"from_pretrained loads {SINGLE_FILE} alone when it exists (not the index), so "
                "the other files' tensors would be missing; use another name"
            )
        return dict(sorted(groups.items()))
    if max_file_bytes is None:
        return {_hf_name(1, 1): names}
    if max_file_bytes < 1:
        raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
    buckets: list[list[str]] = [[]]
    used = 0
    for n in names:
        size = tensors[n].nbytes
        if buckets[-1] and used + size > max_file_bytes:
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
    chunks are byte ranges that may start or end inside an element. A tensor cast on the way
    (``cast_to``) is stitched in whole source elements instead: the stitcher converts elements.
    """
    if t.cast_to is not None:
        return list(t.shape), list(b.offsets), list(b.sizes), t.bits // 8
    if t.encoded:  # packed dtypes (F4): a piece holds whole bytes, two values each
        if not t.shape:
            return [t.bits // 8], [0], [t.bits // 8], 1
        last = len(t.shape) - 1
        return (
            list(t.shape[:last]) + [t.shape[last] * t.bits // 8],
            list(b.offsets[:last]) + [b.offsets[last] * t.bits // 8],
            list(b.sizes[:last]) + [b.sizes[last] * t.bits // 8],
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


def make_plan(
    tensors: ScannedTensors,
    nranks: int,
    fqn_to_file: Mapping[str, int | str] | None,
    max_file_bytes: int | None,
    *,
    whole_files: bool = False,
) -> _Plan:
    """Lays out the output files and cuts the work into one share per rank.

    Args:
        tensors: the scanned (and possibly selected) tensors.
        nranks: ranks sharing the work.
        fqn_to_file: explicit tensor -> file assignment (see ``consolidate``).
        max_file_bytes: bound on a file's data bytes without ``fqn_to_file``.
        whole_files: give every output file to exactly one rank (never split a file between
            ranks), as needed when each rank writes into its own local directory.
    """
    bad = sorted(n for n, t in tensors.items() if t.unsupported)
    if bad:
        raise UnsupportedDtypeError(
            f"tensor {bad[0]!r} has dtype {tensors[bad[0]].unsupported}, which safetensors cannot "
            "represent"
        )
    groups = _assign_files(tensors, fqn_to_file, max_file_bytes)
    token = uuid.uuid4().hex[:12]
    files: list[_OutFile] = []
    for fname, members in groups.items():
        emitted = _C.safetensors_header(
            [_C.TensorSpec(n, tensors[n].out_dtype, list(tensors[n].shape)) for n in members],
            {"format": "pt"},
        )
        header = emitted.header
        files.append(
            _OutFile(
                name=fname,
                tmp=f".{fname}.tmp-{token}",
                header=header,
                size=len(header) + emitted.data_bytes,
                data_start=len(header),
                tensors=[(s.name, s.begin, s.end) for s in emitted.layout],
            )
        )
    unit = {n: max(1, bits // 8) if bits % 8 == 0 else 1
            for n, bits in ((n, t.out_bits) for n, t in tensors.items())}
    work = [[(e - b, unit[n]) for n, b, e in f.tensors] for f in files]
    shares = partition(work, nranks, whole_files=whole_files)
    writers = [0] * len(files)  # the rank that creates and commits each file (whole_files)
    for r, share in enumerate(shares):
        for file_index, _, _ in share:
            writers[file_index] = r
    return _Plan(tensors, files, shares, index_tmp=f".{INDEX_NAME}.tmp-{token}", writers=writers)

