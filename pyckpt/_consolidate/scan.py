"""Consolidation, step 1: scanning the input into ``dict[name, _Tensor]``.

Two input kinds: a directory of safetensors shards (DCP's ``HuggingFaceStorageWriter`` or plain
files) and a pyckpt checkpoint (``pyckpt.json``). Both become the same model: a :class:`_Tensor`
per name, holding the row-major blocks (shards or pieces) that tile it. This mapping is the seam
between scanning and planning: a selection step may filter or rename its entries before
:func:`pyckpt._consolidate.plan.make_plan` lays out the output.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from pyckpt import _C
from pyckpt.errors import CheckpointFormatError, PyckptError

__all__ = ["scan", "is_pyckpt", "ScannedTensors"]

logger = logging.getLogger("pyckpt.consolidate")

_SHARDING_KEY = "DCP_SHARDING_INFO"


class _Block(NamedTuple):
    """Row-major bytes of one shard: ``path`` at absolute ``offset``, hyper-rectangle geometry.

    For a pyckpt piece, ``segments`` holds its stored segments (``_format`` tuples) and the bytes
    come from decoding their chunks; ``path`` is then the first segment's file (for messages).
    A named tuple: one per piece, built and pickled (the export's plan broadcast) several times
    faster than a frozen dataclass, which matters at thousands of tensors.
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
    cast_to: str | None = None  # export: floats converted to this dtype on the way
    unsupported: str | None = None  # pyckpt dtype safetensors cannot hold (dtype is then "")

    @property
    def out_dtype(self) -> str:
        """The dtype written to the output (``dtype`` unless cast)."""
        return self.cast_to or self.dtype

    @property
    def out_bits(self) -> int:
        return self.bits if self.cast_to is None else _C.safetensors_dtype_bits(self.cast_to)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the output."""
        n = self.out_bits
        for d in self.shape:
            n *= d
        return n // 8



#: The seam between scanning and planning: tensor name -> its blocks.
ScannedTensors = dict[str, _Tensor]


# Largest offset accepted in DCP_SHARDING_INFO: a dimension of a stored tensor is at most 2**60
# elements (docs/FORMAT.md, "Limits"), and offset + size must stay a 64-bit integer.
_MAX_OFFSET = 1 << 60


_INT_ONLY = {int}


def _int_tuple(value: Any, path: str, name: str) -> tuple[int, ...]:
    """``value`` (the ``saved_offsets`` of tensor ``name`` in shard ``path``) as a tuple."""
    # Every element's exact type is int (bool is not), all in range: checked with C-level loops
    # (one call per tensor per shard; a generator over the elements cost more than the rest).
    if type(value) is not list or (value and (
        not set(map(type, value)) <= _INT_ONLY or min(value) < 0 or max(value) > _MAX_OFFSET
    )):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointFormatError(
            f"{path}: saved_offsets of {name!r} must be a list of integers in [0, 2**60], "
            f"got {shown}"
        )
    return tuple(value)


def _scan_safetensors(src: str) -> dict[str, _Tensor]:
    """Reads every ``*.safetensors`` header in ``src`` and groups the shards by tensor."""
    # One directory read: each entry's type comes with it (no stat per file on most file systems).
    with os.scandir(src) as it:
        regular = {
            e.name: e.is_file(follow_symlinks=False) for e in it
            if e.name.endswith(".safetensors") and not e.name.startswith(".")
        }
    names = sorted(regular)
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
    base_of: dict[str, str] = {}  # shard path -> its name in src (for messages)
    bits_of: dict[str, int] = {}
    for fname in names:
        path = os.path.join(src, fname)
        base_of[path] = fname
        # Shards are plain files inside src: a symlink could point anywhere (another user's
        # file, a device), so it is refused before anything is opened.
        if not regular[fname]:
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
            except RecursionError:
                raise CheckpointFormatError(
                    f"{path}: {_SHARDING_KEY} is nested too deeply to be DCP sharding information"
                ) from None
            if not isinstance(sharding, dict):
                raise CheckpointFormatError(f"{path}: {_SHARDING_KEY} is not a JSON object")
        data_start = header["data_start"]
        for name, dtype, shape, begin, _end in cast("list[Any]", header["tensors"]):
            if sharding is None:
                offsets = (0,) * len(shape)
            else:
                entry = sharding.get(name)
                if not isinstance(entry, dict) or "saved_offsets" not in entry:
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} has no saved_offsets in {_SHARDING_KEY}"
                    )
                offsets = _int_tuple(entry["saved_offsets"], path, name)
                if len(offsets) != len(shape):
                    raise CheckpointFormatError(
                        f"{path}: tensor {name!r} has shape {list(shape)} but saved_offsets "
                        f"{list(offsets)}"
                    )
            t = tensors.get(name)
            if t is None:
                bits = bits_of.get(dtype)
                if bits is None:
                    bits = bits_of[dtype] = _C.safetensors_dtype_bits(dtype)
                t = tensors[name] = _Tensor(name, dtype, (), bits)
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
            t.blocks.append(_Block(path, data_start + begin, offsets, tuple(shape)))
    for t in tensors.values():
        blocks = t.blocks
        if len(blocks) == 1:
            b = blocks[0]
            if not any(b.offsets):  # the whole tensor in one shard: nothing else to tile
                t.shape = b.sizes
                continue
            t.shape = tuple(o + n for o, n in zip(b.offsets, b.sizes))
        else:
            t.shape = tuple(max(b.offsets[d] + b.sizes[d] for b in blocks)
                            for d in range(len(blocks[0].sizes)))
        _C.check_tiling(t.name, t.shape,
                        [_C.TileBlock(b.offsets, b.sizes, base_of[b.path]) for b in blocks])
    return tensors


#: pyckpt dtype (torch name) -> safetensors dtype. Absent: no safetensors spelling exists
#: (complex128, complex32): such tensors are skipped with a warning unless selected (then
#: UnsupportedDtypeError).
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
    "float4_e2m1fn_x2": "F4",  # two values per torch element: see _PACKED
}

#: Values per torch element, for the packed dtypes: safetensors counts values (its shape of a
#: ``float4_e2m1fn_x2`` tensor of shape ``(m, n)`` is ``[m, 2n]``, as ``safetensors.torch``
#: writes it), so the last dimension and the pieces along it are scaled on the way. A 0-d
#: packed tensor has no last dimension: safetensors cannot hold it.
_PACKED = {"float4_e2m1fn_x2": 2}


def _values(dims: Any, pack: int) -> tuple[int, ...]:
    """``dims`` (a shape, or a piece's offsets or sizes) counted in values, not torch elements."""
    dims = tuple(dims)
    return dims if pack == 1 else dims[:-1] + (dims[-1] * pack,)



def is_pyckpt(src: str) -> bool:
    """True when ``src`` holds a pyckpt checkpoint (``pyckpt.json``)."""
    from pyckpt._format import METADATA_FILE

    return os.path.isfile(os.path.join(src, METADATA_FILE))


def _scan_pyckpt(
    src: str, check_files: bool = True, others: list[str] | None = None
) -> dict[str, _Tensor]:
    """Reads a pyckpt checkpoint's metadata; every stored tensor becomes a _Tensor of pieces.

    A tensor whose dtype safetensors cannot hold is kept with ``unsupported`` set (and no
    blocks): the selection step skips it with a warning, or refuses it when it is selected.
    ``others`` receives the names of the non-tensor items.
    """
    from pyckpt._format import DTYPE_SIZES, read_index

    index = read_index(src, all_files=check_files)
    if others is not None:
        others.extend(index.bytes_items)
    if index.bytes_items:
        logger.info(
            "%s: skipping %d non-tensor item(s) (DCP BYTE_IO values have no safetensors form)",
            src, len(index.bytes_items),
        )
    if not index.tensors:
        raise CheckpointFormatError(f"{src}: the checkpoint holds no tensors to consolidate")
    tensors: dict[str, _Tensor] = {}
    no_data = os.path.join(src, "<no data>")
    bits_of: dict[str, int] = {}
    for name in sorted(index.tensors):
        st = index.tensors[name]
        dtype = _ST_DTYPES.get(st.dtype)
        pack = _PACKED.get(st.dtype, 1)
        if dtype is None or (pack != 1 and not st.shape):
            tensors[name] = _Tensor(
                name, "", tuple(st.shape), 8 * DTYPE_SIZES.get(st.dtype, 0), unsupported=st.dtype
            )
            continue
        bits = bits_of.get(dtype)
        if bits is None:
            bits = bits_of[dtype] = _C.safetensors_dtype_bits(dtype)
            if bits * pack != 8 * DTYPE_SIZES[st.dtype]:  # the two tables must agree
                raise PyckptError(f"dtype tables disagree on {st.dtype} / {dtype}")
        # read_index checked that the pieces tile the tensor (a second check here cost as much
        # as the rest of this loop at thousands of tensors).
        if pack == 1:
            tensors[name] = _Tensor(name, dtype, st.shape, bits, encoded=True, blocks=[
                _Block(segs[0][0] if segs else no_data, 0, piece.offsets, piece.sizes, segs)
                for piece in st.pieces for segs in (tuple(piece.segments),)])
        else:
            tensors[name] = _Tensor(name, dtype, _values(st.shape, pack), bits, encoded=True,
                                    blocks=[_Block(segs[0][0] if segs else no_data, 0,
                                                   _values(piece.offsets, pack),
                                                   _values(piece.sizes, pack), segs)
                                            for piece in st.pieces
                                            for segs in (tuple(piece.segments),)])
    return tensors



def scan(
    src: str, *, check_files: bool = True, others: list[str] | None = None
) -> ScannedTensors:
    """Reads the input's headers or metadata: every tensor with the blocks that tile it.

    Args:
        src: a pyckpt checkpoint directory or a directory of ``*.safetensors`` files.
        check_files: for a pyckpt checkpoint, require every data file the metadata names to be
            present in ``src`` (off for node-local checkpoints, whose files are spread over
            the nodes).
        others: if given, receives the names of a pyckpt checkpoint's non-tensor items.
    """
    if is_pyckpt(src):
        return _scan_pyckpt(src, check_files=check_files, others=others)
    return _scan_safetensors(src)
