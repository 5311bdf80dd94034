"""Generates a corpus of hostile and damaged checkpoints (pyckpt and safetensors).

Usage::

    python tests/attacks/generate.py OUT_DIR     # writes OUT_DIR/cases/<name>/ and OUT_DIR/outside/

Layout of the corpus (everything is generated, nothing large is committed)::

    OUT_DIR/cases/<name>/DESCRIPTION what the case does, one paragraph
    OUT_DIR/cases/<name>/case.json   {"name", "kind", "may_pass", "any_error", "description"}
    OUT_DIR/cases/<name>/ckpt/       the hostile checkpoint (pyckpt dir or safetensors dir)
    OUT_DIR/cases/<name>/outside/    files that no reader may open (targets of symlinks and
                                     traversal names; the marker a malicious pickle would write)

Each case has its own ``outside/`` so that cases can run in parallel and an access is always
attributed to the case that caused it.

Every pyckpt case starts from a real checkpoint written by :func:`pyckpt.save` (so it follows the
format of the tree under test) and changes one thing. Metadata is written by
:func:`write_metadata`, which adds the metadata checksum when the format under test has one, so
a case probes the validation behind the checksum, not the checksum itself.

``may_pass`` lists the operations that may legitimately succeed on a case (e.g. ``inspect``
reads no tensor data, so a damaged data file does not concern it); every other operation must
fail with a typed error (a :class:`pyckpt.PyckptError` or ``OSError`` subclass).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OPS_PYCKPT",
    "OPS_SAFETENSORS",
    "MARKER",
    "Case",
    "CASES",
    "seal",
    "write_metadata",
    "write_metadata_raw",
    "read_metadata",
    "generate",
    "baseline_state_dict",
]

#: Operations the harness runs on every pyckpt case and on every safetensors case.
OPS_PYCKPT = ("load", "dcp_load", "verify", "inspect", "convert", "consolidate")
OPS_SAFETENSORS = ("st_header", "consolidate")

#: Name of the file (in ``outside/``) that the malicious pickle case would create.
MARKER = "PWNED"

_META = "pyckpt.json"
_CHUNK = 4096  # chunk_bytes of the baseline: tensor "w" (8 KiB) has two chunks


# ------------------------------------------------------------------------------------ metadata


def _format_seals() -> bool:
    """True when the format under test ends its metadata with a checksum member.

    Format version 1 has none; later versions end the JSON object with
    ``,"checksum":"xxh64:<16 hex digits>"}`` over every byte before that member.
    """
    from pyckpt import _format

    return int(_format.FORMAT_VERSION) >= 2


def seal(body: bytes) -> bytes:
    """Appends the metadata checksum member to the compact JSON object ``body`` (when the format
    under test has one; otherwise returns ``body``). ``body`` need not be valid JSON: only its
    last byte must be ``}``, so hostile documents get a valid checksum too."""
    if not _format_seals():
        return body
    from pyckpt import _C

    if not body.endswith(b"}"):
        raise ValueError("a sealed metadata body must end with '}'")
    head = body[:-1]
    return head + b',"checksum":"xxh64:' + b"%016x" % _C.xxh64(head) + b'"}'


def dumps(doc: Any) -> bytes:
    """Compact UTF-8 JSON as the writer produces it."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def write_metadata_raw(ckpt: str, body: bytes, *, sealed: bool = True) -> None:
    """Writes ``body`` (sealed with a valid checksum unless ``sealed=False``) as pyckpt.json."""
    with open(os.path.join(ckpt, _META), "wb") as f:
        f.write(seal(body) if sealed else body)


def write_metadata(ckpt: str, doc: dict[str, Any]) -> None:
    """The single place that writes a (possibly hostile) metadata document with a valid
    checksum, in the scheme of the format under test."""
    doc = dict(doc)
    doc.pop("checksum", None)
    write_metadata_raw(ckpt, dumps(doc))


def read_metadata(ckpt: str) -> dict[str, Any]:
    """Parses pyckpt.json without validation, dropping its checksum member."""
    with open(os.path.join(ckpt, _META), "rb") as f:
        doc = json.loads(f.read())
    doc.pop("checksum", None)
    return doc


# ------------------------------------------------------------------------------------ baseline


def baseline_state_dict() -> dict[str, Any]:
    """The state dict of every pyckpt case's starting checkpoint (deterministic)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "b": torch.randn(16, generator=g),
        "extra": {"step": 7},
    }


def load_template() -> dict[str, Any]:
    """A state dict of the baseline's structure to load into (zeros)."""
    import torch

    return {
        "w": torch.zeros(64, 64, dtype=torch.bfloat16),
        "b": torch.zeros(16),
        "extra": {"step": 0},
    }


def _save_baseline(ckpt: str) -> None:
    import warnings

    import pyckpt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyckpt.save(baseline_state_dict(), ckpt, compression="zstd", chunk_bytes=_CHUNK,
                    fsync=False)


# ------------------------------------------------------------------------------------ cases


@dataclass
class Ctx:
    """What a case builder works on."""

    root: str  # the corpus root
    case: str  # the case directory
    ckpt: str  # the checkpoint directory inside it
    outside: str  # files no reader may touch

    @property
    def doc(self) -> dict[str, Any]:
        return read_metadata(self.ckpt)

    def data_file(self) -> str:
        """The baseline's (single) data file name."""
        (name,) = self.doc["files"]
        return name

    def rename_data_file(self, doc: dict[str, Any], new: str) -> dict[str, Any]:
        """Renames the data file in ``doc`` (files and every segment) to ``new``."""
        old = self.data_file()
        doc["files"] = {new: doc["files"][old]}
        for item in doc["items"].values():
            segs = item.get("segments", [])
            for p in item.get("pieces", []):
                segs = segs + p["segments"]
            for s in segs:
                s["file"] = new
        return doc

    def w_chunks(self, doc: dict[str, Any]) -> list[list[Any]]:
        return doc["items"]["w"]["pieces"][0]["segments"][0]["chunks"]


@dataclass
class Case:
    """One hostile input."""

    name: str
    description: str
    build: Callable[[Ctx], None]
    kind: str = "pyckpt"  # or "safetensors"
    may_pass: tuple[str, ...] = ()
    #: Operations for which any exception (not only a typed one) is acceptable, as long as the
    #: process neither crashes nor hangs nor touches outside/ (the pickle case: refusing to
    #: unpickle may surface as pickle.UnpicklingError).
    any_error: tuple[str, ...] = ()
    #: Operations documented to unpickle non-tensor values with weights_only=False: dcp.load with
    #: DCP's own DefaultLoadPlanner (pyckpt.Reader only supplies the bytes). For them the test
    #: asserts that the payload DOES run, so the documented behaviour stays true.
    trusts_pickles: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


CASES: list[Case] = []


def case(name: str, description: str, kind: str = "pyckpt", may_pass: tuple[str, ...] = (),
         any_error: tuple[str, ...] = (), trusts_pickles: tuple[str, ...] = ()
         ) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def register(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        CASES.append(Case(name, description, fn, kind, may_pass, any_error, trusts_pickles))
        return fn

    return register


def _edit(fn: Callable[[dict[str, Any], Ctx], Any]) -> Callable[[Ctx], None]:
    """Case builder that edits the metadata document and rewrites it with a valid checksum."""

    def build(c: Ctx) -> None:
        doc = c.doc
        fn(doc, c)
        write_metadata(c.ckpt, doc)

    return build


def _traversal(new_name: Callable[[Ctx, str], str], place: Callable[[Ctx, str], str]
               ) -> Callable[[Ctx], None]:
    def build(c: Ctx) -> None:
        old = c.data_file()
        new = new_name(c, old)
        dest = place(c, old)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(os.path.join(c.ckpt, old), dest)
        os.unlink(os.path.join(c.ckpt, old))
        write_metadata(c.ckpt, c.rename_data_file(c.doc, new))

    return build


# --- data file names and special files

case("name_dotdot", "data file named '../<name>': the file lies next to the checkpoint "
     "directory, not in it")(_traversal(
         lambda c, old: "../" + old, lambda c, old: os.path.join(c.case, old)))
case("name_traversal_outside", "data file named '../outside/<name>', reaching the case's "
     "outside/ directory")(_traversal(
         lambda c, old: "../outside/" + old, lambda c, old: os.path.join(c.outside, old)))
case("name_absolute", "data file named by an absolute path into outside/")(_traversal(
    lambda c, old: os.path.join(c.outside, "abs-" + old),
    lambda c, old: os.path.join(c.outside, "abs-" + old)))
case("name_separator", "data file named 'sub/<name>' (a path with a separator, inside the "
     "checkpoint)")(_traversal(
         lambda c, old: "sub/" + old, lambda c, old: os.path.join(c.ckpt, "sub", old)))
case("name_trailing_newline", "data file name ending in a newline (matches a regex anchored "
     "with '$'); the file exists under that name")(_traversal(
         lambda c, old: old + "\n", lambda c, old: os.path.join(c.ckpt, old + "\n")))


def _unicode_digits(c: Ctx, old: str) -> str:
    rank, rest = old.split("-", 1)
    k, tail = rest.split(".", 1)
    return "\u0660-\u0660." + tail  # ARABIC-INDIC DIGIT ZERO: matches \d, not [0-9]


case("name_unicode_digits", "data file named with Arabic-Indic digits for rank and index "
     "(matches \\d); the file exists under that name")(_traversal(
         _unicode_digits, lambda c, old: os.path.join(c.ckpt, _unicode_digits(c, old))))


@case("data_symlink_outside", "the data file is a symlink to an identical file in outside/",
      may_pass=("inspect",))
def _data_symlink(c: Ctx) -> None:
    name = c.data_file()
    target = os.path.join(c.outside, "link-" + name)
    shutil.copyfile(os.path.join(c.ckpt, name), target)
    os.unlink(os.path.join(c.ckpt, name))
    os.symlink(target, os.path.join(c.ckpt, name))


@case("metadata_symlink_outside", "pyckpt.json is a symlink to a valid metadata file in "
      "outside/")
def _meta_symlink(c: Ctx) -> None:
    target = os.path.join(c.outside, "linked-pyckpt.json")
    shutil.copyfile(os.path.join(c.ckpt, _META), target)
    os.unlink(os.path.join(c.ckpt, _META))
    os.symlink(target, os.path.join(c.ckpt, _META))


@case("data_fifo", "the data file is a FIFO (opening it for reading blocks forever without "
      "O_NONBLOCK)", may_pass=("inspect",))
def _data_fifo(c: Ctx) -> None:
    name = c.data_file()
    os.unlink(os.path.join(c.ckpt, name))
    os.mkfifo(os.path.join(c.ckpt, name))


@case("metadata_fifo", "pyckpt.json is a FIFO (opening it for reading blocks forever)")
def _meta_fifo(c: Ctx) -> None:
    os.unlink(os.path.join(c.ckpt, _META))
    os.mkfifo(os.path.join(c.ckpt, _META))


@case("data_directory", "the data file is a directory")
def _data_dir(c: Ctx) -> None:
    name = c.data_file()
    os.unlink(os.path.join(c.ckpt, name))
    os.mkdir(os.path.join(c.ckpt, name))


@case("data_truncated", "the data file is cut to half its recorded size")
def _data_truncated(c: Ctx) -> None:
    path = os.path.join(c.ckpt, c.data_file())
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


# --- offsets, lengths, sizes

case("offset_beyond_file", "a chunk of 'w' starts 100 bytes past the end of its data file")(
    _edit(lambda d, c: c.w_chunks(d)[1].__setitem__(0, d["files"][c.data_file()] + 100)))


def _stored_len(n: int) -> Callable[[dict[str, Any], Ctx], None]:
    def f(d: dict[str, Any], c: Ctx) -> None:
        c.w_chunks(d)[0][4][1] = n

    return f


case("length_beyond_file", "a plane of a chunk of 'w' claims 1 MiB, past the end of the file")(
    _edit(_stored_len(1 << 20)))
case("stored_length_1tib", "a plane of a chunk of 'w' claims a stored length of 1 TiB")(
    _edit(_stored_len(1 << 40)))
case("stored_length_2_64", "a plane of a chunk of 'w' claims 2**64 bytes (does not fit uint64)")(
    _edit(_stored_len(1 << 64)))
case("offset_2_64_minus_1", "a chunk offset of 2**64-1 (offset + length wraps around in uint64)")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(0, (1 << 64) - 1)))
case("offset_2_60", "a chunk offset of 2**60")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(0, 1 << 60)))
case("file_size_2_60", "the recorded size of the data file is 2**60")(
    _edit(lambda d, c: d["files"].__setitem__(c.data_file(), 1 << 60)))
case("file_size_2_64", "the recorded size of the data file is 2**64")(
    _edit(lambda d, c: d["files"].__setitem__(c.data_file(), 1 << 64)))


def _shape(n: int) -> Callable[[dict[str, Any], Ctx], None]:
    def f(d: dict[str, Any], c: Ctx) -> None:
        w = d["items"]["w"]
        w["shape"] = [n, 64]
        w["pieces"][0]["sizes"] = [n, 64]

    return f


case("shape_2_60", "'w' has shape [2**60, 64] and its piece the same sizes (2**67 bytes) over "
     "8 KiB of chunks")(_edit(_shape(1 << 60)))
case("shape_2_64", "'w' has shape [2**64, 64]")(_edit(_shape(1 << 64)))
case("shape_product_overflow", "'w' has shape [2**32, 2**32, 2**32] (numel overflows int64)")(
    _edit(lambda d, c: d["items"]["w"].update(
        shape=[1 << 32] * 3, pieces=[dict(d["items"]["w"]["pieces"][0], offsets=[0, 0, 0],
                                          sizes=[1 << 32] * 3)])))
case("raw_len_2_60", "a chunk of 'w' claims 2**60 raw bytes")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(1, 1 << 60)))
case("float_offset", "a chunk offset is the float 0.5")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(0, 0.5)))
case("float_integral_offset", "a chunk offset is the float 0.0 (equal to 0 in Python)")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(0, 0.0)))
case("bool_offset", "the second chunk offset of 'w' is true (an int subclass in Python)")(
    _edit(lambda d, c: c.w_chunks(d)[1].__setitem__(0, True)))
case("negative_offset", "a chunk offset is -1")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(0, -1)))


def _bomb(c: Ctx) -> None:
    from pyckpt import _C

    doc = c.doc
    name = c.data_file()
    path = os.path.join(c.ckpt, name)
    raw = 64 << 20
    stored, rec = _C.encode_chunk(bytes(raw), _C.CodecParams("zstd", 1, 1, "none"))
    off = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(stored)
    doc["files"][name] = off + len(stored)
    n = 16384
    chunks = [[off, raw, rec[2], 0, list(rec[4])] for _ in range(n)]
    doc["items"]["bomb"] = {
        "type": "tensor", "dtype": "uint8", "shape": [n * raw], "requires_grad": False,
        "memory_format": "contiguous_format",
        "pieces": [{"offsets": [0], "sizes": [n * raw], "segments": [
            {"file": name, "raw_begin": 0, "codec": ["zstd", 1, 1, "none"], "chunks": chunks}]}],
    }
    write_metadata(c.ckpt, doc)


case("decompression_bomb", "tensor 'bomb' (uint8, 1 TiB) of 16,384 chunk records that all point "
     "at one zstd frame of 64 MiB zeros (a few KiB on disk); checksums valid")(_bomb)


def _overlap(d: dict[str, Any], c: Ctx) -> None:
    ch = c.w_chunks(d)
    ch[1][:] = [ch[0][0], ch[0][1], ch[0][2], ch[0][3], list(ch[0][4])]


case("overlapping_chunks", "both chunks of 'w' point at the same stored bytes (valid checksums); "
     "the load returns the first half twice")(_edit(_overlap))


def _b_over_w(d: dict[str, Any], c: Ctx) -> None:
    # 'b' (64 raw bytes) reuses the first 64 stored bytes of 'w': plane lengths of 'w'.
    b = d["items"]["b"]["pieces"][0]["segments"][0]
    b["codec"] = ["none", 0, 1, "none"]
    w0 = c.w_chunks(d)[0]
    from pyckpt import _C

    with open(os.path.join(c.ckpt, c.data_file()), "rb") as f:
        f.seek(w0[0])
        data = f.read(64)
    b["chunks"] = [[w0[0], 64, _C.xxh64(data), 0, [0, 64]]]


case("cross_item_overlap", "tensor 'b' is stored in the bytes of 'w' (raw codec, valid checksum)")(
    _edit(_b_over_w))


# --- unknown or inconsistent codec parameters

case("unknown_codec", "codec 'lz4'")(
    _edit(lambda d, c: d["items"]["w"]["pieces"][0]["segments"][0]["codec"].__setitem__(0, "lz4")))
case("unknown_transform", "transform 'shuffle'")(
    _edit(lambda d, c: d["items"]["w"]["pieces"][0]["segments"][0]["codec"].__setitem__(
        3, "shuffle")))
case("unknown_transform_code", "chunk transform code 7")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(3, 7)))
case("transform_code_changed", "the chunk transform code of 'w' is changed from 2 "
     "(group_rotl1) to 1 (group): data checksums stay valid, the decoded values would be wrong")(
    _edit(lambda d, c: [ch.__setitem__(3, 1) for ch in c.w_chunks(d)]))
case("unknown_plane_mode", "plane mode 7")(
    _edit(lambda d, c: c.w_chunks(d)[0][4].__setitem__(0, 7)))
case("planes_18", "a chunk of 'w' (elem_size 2) lists 18 plane entries (9 planes)")(
    _edit(lambda d, c: c.w_chunks(d)[0].__setitem__(4, c.w_chunks(d)[0][4] + [0, 0] * 7)))
case("elem_size_3", "codec elem_size 3")(
    _edit(lambda d, c: d["items"]["w"]["pieces"][0]["segments"][0]["codec"].__setitem__(2, 3)))
case("zstd_level_1000", "codec level 1000")(
    _edit(lambda d, c: d["items"]["w"]["pieces"][0]["segments"][0]["codec"].__setitem__(1, 1000)))
case("unknown_dtype", "dtype 'float4'")(
    _edit(lambda d, c: d["items"]["w"].__setitem__("dtype", "float4")))
case("unknown_item_type", "item type 'module'")(
    _edit(lambda d, c: d["items"]["w"].__setitem__("type", "module")))
case("unknown_version", "version 99")(_edit(lambda d, c: d.__setitem__("version", 99)))
case("version_float", "version 1.0 (equal to 1 in Python)")(
    _edit(lambda d, c: d.__setitem__("version", float(d["version"]))))
case("version_true", "version true (equal to 1 in Python)")(
    _edit(lambda d, c: d.__setitem__("version", True)))
case("version_string", "version \"1\"")(
    _edit(lambda d, c: d.__setitem__("version", str(d["version"]))))

# --- coverage

case("pieces_empty", "'w' has no pieces at all")(
    _edit(lambda d, c: d["items"]["w"].__setitem__("pieces", [])))


def _half(d: dict[str, Any], c: Ctx) -> None:
    w = d["items"]["w"]
    p = w["pieces"][0]
    p["sizes"] = [32, 64]
    p["segments"][0]["chunks"] = p["segments"][0]["chunks"][:1]


case("pieces_half", "'w' (64x64) has one piece covering rows 0-31 only")(_edit(_half))


def _dup_piece(d: dict[str, Any], c: Ctx) -> None:
    w = d["items"]["w"]
    p = w["pieces"][0]
    half = json.loads(json.dumps(p))
    half["sizes"] = [32, 64]
    half["segments"][0]["chunks"] = half["segments"][0]["chunks"][:1]
    w["pieces"] = [p, half]


case("pieces_overlap", "'w' has its full piece plus a second piece over rows 0-31")(
    _edit(_dup_piece))
case("piece_outside_shape", "a piece of 'w' at offsets [32, 0] with sizes [64, 64]")(
    _edit(lambda d, c: d["items"]["w"]["pieces"][0].__setitem__("offsets", [32, 0])))

# --- JSON encoding


@case("json_nested_100k", "metadata whose JSON nests 100,000 arrays deep")
def _nested(c: Ctx) -> None:
    doc = c.doc
    doc["storage_meta"] = "@@"
    body = dumps(doc).replace(b'"@@"', b"[" * 100_000 + b"]" * 100_000)
    write_metadata_raw(c.ckpt, body)


@case("json_non_utf8", "a tensor name holds the byte 0xff (not UTF-8)")
def _non_utf8(c: Ctx) -> None:
    body = dumps(c.doc).replace(b'"b":{"type"', b'"b\xff":{"type"')
    write_metadata_raw(c.ckpt, body)


@case("json_utf16", "the metadata encoded as UTF-16-LE with a BOM (json.loads accepts it)")
def _utf16(c: Ctx) -> None:
    body = dumps(c.doc)
    text = seal(body).decode("utf-8")
    with open(os.path.join(c.ckpt, _META), "wb") as f:
        f.write(b"\xff\xfe" + text.encode("utf-16-le"))


@case("json_bom", "the metadata starts with a UTF-8 byte order mark")
def _bom(c: Ctx) -> None:
    body = seal(dumps(c.doc))
    with open(os.path.join(c.ckpt, _META), "wb") as f:
        f.write(b"\xef\xbb\xbf" + body)


@case("json_duplicate_item", "item 'w' appears twice; the second copy has dtype float16 and a "
      "piece of rows 0-31 (json.loads keeps the last)")
def _dup_item(c: Ctx) -> None:
    doc = c.doc
    w = json.loads(json.dumps(doc["items"]["w"]))
    w["dtype"] = "float16"
    w["pieces"][0]["sizes"] = [32, 64]
    w["pieces"][0]["segments"][0]["chunks"] = w["pieces"][0]["segments"][0]["chunks"][:1]
    body = dumps(doc)
    items_at = body.index(b'"items":{') + len(b'"items":{')
    body = body[:items_at] + b'"w":' + dumps(doc["items"]["w"]) + b"," + body[items_at:]
    body = body.replace(b',"b":{"type"', b',"w":' + dumps(w) + b',"b":{"type"', 1)
    # The first "w" is now followed by the original "w" and the altered one: three in all.
    write_metadata_raw(c.ckpt, body)


@case("json_duplicate_version", "the key 'version' appears twice (99, then the real version)")
def _dup_version(c: Ctx) -> None:
    body = dumps(c.doc).replace(b'"version":', b'"version":99,"version":', 1)
    write_metadata_raw(c.ckpt, body)


@case("json_nan", "a chunk offset is NaN (not JSON; Python's json accepts it)")
def _nan(c: Ctx) -> None:
    doc = c.doc
    c.w_chunks(doc)[0][0] = "@@"
    write_metadata_raw(c.ckpt, dumps(doc).replace(b'"@@"', b"NaN"))


@case("json_huge_int", "a chunk offset with 5,000 digits")
def _huge_int(c: Ctx) -> None:
    doc = c.doc
    c.w_chunks(doc)[0][0] = "@@"
    write_metadata_raw(c.ckpt, dumps(doc).replace(b'"@@"', b"9" * 5000))


@case("json_not_object", "the metadata is a JSON array")
def _array(c: Ctx) -> None:
    write_metadata_raw(c.ckpt, b'[{"format":"pyckpt"}]', sealed=False)


@case("json_truncated", "the metadata is cut in half")
def _truncated(c: Ctx) -> None:
    with open(os.path.join(c.ckpt, _META), "rb") as f:
        raw = f.read()
    with open(os.path.join(c.ckpt, _META), "wb") as f:
        f.write(raw[: len(raw) // 2])


@case("metadata_empty", "pyckpt.json is empty")
def _empty(c: Ctx) -> None:
    open(os.path.join(c.ckpt, _META), "wb").close()


case("planner_data_tuple_int", "planner_data {'__tuple__': 5} (a tuple tag holding an int)")(
    _edit(lambda d, c: d["planner_data"].__setitem__("w", {"__tuple__": 5})))
case("planner_data_not_mapping", "planner_data is a list (DCP's planner_data is any value: a "
     "reader may accept it; it must not crash)", may_pass=OPS_PYCKPT)(
    _edit(lambda d, c: d.__setitem__("planner_data", [1, 2])))
case("files_not_object", "'files' is a list")(
    _edit(lambda d, c: d.__setitem__("files", list(d["files"]))))
case("items_missing", "no 'items' member")(_edit(lambda d, c: d.pop("items")))
case("segments_unknown_file", "a segment names a data file not listed in 'files'")(
    _edit(lambda d, c: d["items"]["w"]["pieces"][0]["segments"][0].__setitem__(
        "file", "9-9.000000000000.pyckpt")))

# Found by the metadata fuzzer (tests/test_fuzz_metadata.py) on the starting commit.
case("fuzz_chunks_int", "a segment's 'chunks' is the integer 2")(
    _edit(lambda d, c: d["items"]["b"]["pieces"][0]["segments"][0].__setitem__("chunks", 2)))
case("fuzz_segments_null", "a piece's 'segments' is null")(
    _edit(lambda d, c: d["items"]["b"]["pieces"][0].__setitem__("segments", None)))
case("fuzz_raw_begin_float", "a segment's raw_begin is 0.0")(
    _edit(lambda d, c: d["items"]["b"]["pieces"][0]["segments"][0].__setitem__("raw_begin", 0.0)))
case("fuzz_pieces_missing", "tensor 'w' has no 'pieces' member (loads as zeros when defaulted)")(
    _edit(lambda d, c: d["items"]["w"].pop("pieces")))
case("fuzz_codec_level_out_of_range", "codec level 4097 (the codec binding refuses it with a "
     "ValueError at load time)")(
    _edit(lambda d, c: d["items"]["b"]["pieces"][0]["segments"][0]["codec"].__setitem__(1, 4097)))

# --- BYTE_IO values


def _byteio_1tib(d: dict[str, Any], c: Ctx) -> None:
    item = d["items"]["extra.step"]
    item["nbytes"] = 1 << 40
    item["segments"][0]["chunks"][0][1] = 1 << 40


case("byteio_1tib", "BYTE_IO item 'extra.step' claims 1 TiB of raw bytes (one chunk of a few "
     "hundred stored bytes)")(_edit(_byteio_1tib))


class _Pwn:
    """Unpickling this writes the marker file (the harness checks it never appears)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        code = f"open({self.path!r}, 'w').write('unpickled')"
        return (exec, (code,))


@case("malicious_pickle", "BYTE_IO item 'extra.step' holds a pickle that writes outside/PWNED "
      "when unpickled; its chunk checksum is valid", may_pass=("inspect", "verify", "consolidate"),
      any_error=("load", "convert"), trusts_pickles=("dcp_load",))
def _pickle(c: Ctx) -> None:
    # Written by the writer itself (DCP torch.save()s the value), so the checkpoint is valid in
    # every respect, checksums and chunk coverage included: only unpickling can stop it.
    import warnings

    import pyckpt

    shutil.rmtree(c.ckpt)
    sd = baseline_state_dict()
    sd["extra"]["step"] = _Pwn(os.path.join(c.outside, MARKER))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyckpt.save(sd, c.ckpt, compression="zstd", chunk_bytes=_CHUNK, fsync=False)


# ------------------------------------------------------------------------------------ safetensors


def _st_bytes(tensors: list[tuple[str, str, list[int], bytes]], *, header_extra: bytes = b"",
              header: bytes | None = None) -> bytes:
    h: dict[str, Any] = {}
    data = b""
    for name, dtype, shape, raw in tensors:
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    hb = header if header is not None else json.dumps(h, separators=(",", ":")).encode()
    hb += header_extra
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


_ST_OK = [("a", "F32", [4], b"\0" * 16), ("b", "BF16", [2, 2], b"\1" * 8)]


def _st(body: Callable[[Ctx], bytes], name: str = "model.safetensors") -> Callable[[Ctx], None]:
    def build(c: Ctx) -> None:
        with open(os.path.join(c.ckpt, name), "wb") as f:
            f.write(body(c))

    return build


def _st_header(h: dict[str, Any], data: bytes) -> bytes:
    hb = json.dumps(h, separators=(",", ":")).encode()
    return struct.pack("<Q", len(hb)) + hb + data


def st_case(name: str, description: str, may_pass: tuple[str, ...] = ()
            ) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    return case(name, description, kind="safetensors", may_pass=may_pass)


st_case("st_header_len_beyond_file", "the 8-byte header length exceeds the file size")(
    _st(lambda c: (lambda b: struct.pack("<Q", len(b) + 100) + b[8:])(_st_bytes(_ST_OK))))
st_case("st_header_len_2_64", "header length 2**64-1")(
    _st(lambda c: struct.pack("<Q", (1 << 64) - 1) + _st_bytes(_ST_OK)[8:]))
st_case("st_header_len_1tib", "header length 1 TiB in a file of 100 bytes")(
    _st(lambda c: struct.pack("<Q", 1 << 40) + _st_bytes(_ST_OK)[8:]))
st_case("st_short_file", "a 5-byte file")(_st(lambda c: b"\x08\0\0\0\0"))
st_case("st_overlapping_data", "two tensors with the same data_offsets")(
    _st(lambda c: _st_header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                              "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                             b"\0" * 16)))
st_case("st_offsets_beyond_file", "a tensor's data_offsets end past the end of the file")(
    _st(lambda c: _st_header({"a": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}},
                             b"\0" * 16)))
st_case("st_offsets_2_64", "data_offsets [0, 2**64]")(
    _st(lambda c: _st_header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 64]}},
                             b"\0" * 16)))
st_case("st_unknown_dtype", "dtype 'F7'")(
    _st(lambda c: _st_header({"a": {"dtype": "F7", "shape": [4], "data_offsets": [0, 16]}},
                             b"\0" * 16)))
st_case("st_huge_shape", "shape [2**62, 2**62] with 16 bytes of data")(
    _st(lambda c: _st_header({"a": {"dtype": "F32", "shape": [1 << 62, 1 << 62],
                                    "data_offsets": [0, 16]}}, b"\0" * 16)))
st_case("st_shape_2_64", "shape [2**64]")(
    _st(lambda c: _st_header({"a": {"dtype": "U8", "shape": [1 << 64], "data_offsets": [0, 16]}},
                             b"\0" * 16)))
st_case("st_duplicate_names", "the tensor name 'a' appears twice in the header")(
    _st(lambda c: (lambda hb: struct.pack("<Q", len(hb)) + hb + b"\0" * 32)(
        b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
        b'"a":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}')))
st_case("st_non_utf8_header", "a tensor name holds the byte 0xff")(
    _st(lambda c: (lambda hb: struct.pack("<Q", len(hb)) + hb + b"\0" * 16)(
        b'{"a\xff":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}')))
st_case("st_nested_header", "a header whose __metadata__ nests 100,000 objects deep")(
    _st(lambda c: (lambda hb: struct.pack("<Q", len(hb)) + hb + b"\0" * 16)(
        b'{"__metadata__":' + b'{"x":' * 100_000 + b"1" + b"}" * 100_000 +
        b',"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}')))


@st_case("st_index_outside", "model.safetensors.index.json maps a tensor to "
         "'../outside/x.safetensors'; the directory's own shard is valid",
         may_pass=("st_header", "consolidate"))
def _st_index(c: Ctx) -> None:
    with open(os.path.join(c.outside, "x.safetensors"), "wb") as f:
        f.write(_st_bytes(_ST_OK))
    with open(os.path.join(c.ckpt, "model-00001-of-00001.safetensors"), "wb") as f:
        f.write(_st_bytes(_ST_OK[:1]))
    with open(os.path.join(c.ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors",
                                                  "b": "../outside/x.safetensors"}}, f)


@st_case("st_symlink_outside", "the shard is a symlink to a valid file in outside/")
def _st_symlink(c: Ctx) -> None:
    target = os.path.join(c.outside, "linked.safetensors")
    with open(target, "wb") as f:
        f.write(_st_bytes(_ST_OK))
    os.symlink(target, os.path.join(c.ckpt, "model.safetensors"))


@st_case("st_fifo", "the shard is a FIFO")
def _st_fifo(c: Ctx) -> None:
    os.mkfifo(os.path.join(c.ckpt, "model.safetensors"))


# --- format version 4: the metadata shards (pyckpt._format_shards)
#
# Each case re-saves the baseline as a sharded checkpoint (one rank, one shard at the end of its
# data file), then damages the global document or the shard. A shard edited in place keeps its
# length; "resealed" shards get a valid seal and the global document the shard's new digest, so
# the checks behind the digest are the ones tested.


def _sharded(c: Ctx) -> tuple[dict[str, Any], str, list[Any]]:
    """Re-saves the baseline into ``c.ckpt`` sharded; returns (global doc, data file path, its
    shards entry [rank, offset, length, xxh64])."""
    import warnings

    import pyckpt

    shutil.rmtree(c.ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyckpt.save(baseline_state_dict(), c.ckpt, compression="zstd", chunk_bytes=_CHUNK,
                    fsync=False, metadata_shards=True)
    doc = c.doc
    (entry,) = doc["shards"]
    return doc, os.path.join(c.ckpt, shard_file(doc, entry)), entry


def shard_file(doc: dict[str, Any], entry: list[Any]) -> str:
    """The data file holding the shard of ``entry`` (of a version-4 ``doc``'s shards): its
    rank's first file of the save."""
    return f"{entry[0]}-0.{doc['save_id']}.pyckpt"


def _write_global(c: Ctx, doc: dict[str, Any]) -> None:
    """Writes a version-4 pyckpt.json (its members in the writer's order, sealed)."""
    write_metadata(c.ckpt, doc)


def shard_text(stored: bytes) -> bytes:
    """A stored metadata shard's JSON text (the writer stores one zstd frame of it)."""
    from pyckpt import _C

    return _C.zstd_unframe(stored, 1 << 28) if stored[:4] == b"\x28\xb5\x2f\xfd" else stored


def _restore_shard(c: Ctx, doc: dict[str, Any], path: str, entry: list[Any], new: bytes) -> None:
    """Puts ``new`` in place of the shard at the end of ``path``; the shard's length and digest
    in the global document follow (the data file ends with it)."""
    from pyckpt import _C

    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:entry[1]] + new)
    entry[2], entry[3] = len(new), _C.xxh64(new)
    _write_global(c, doc)


def _reshard(edit: Callable[[dict[str, Any]], Any], compress: bool = True
             ) -> Callable[[Ctx], None]:
    """Case builder: edits the parsed shard, writes it back sealed (and compressed, as the
    writer stores it) in place of the old one (the global document's length and digest
    follow)."""

    def build(c: Ctx) -> None:
        from pyckpt import _C

        doc, path, entry = _sharded(c)
        with open(path, "rb") as f:
            data = f.read()
        shard = json.loads(shard_text(data[entry[1]:]))
        shard.pop("checksum")
        edit(shard)
        new = seal(dumps(shard))
        _restore_shard(c, doc, path, entry, _C.zstd_frame(new) if compress else new)

    return build


def _restore_raw(make: Callable[[bytes], bytes]) -> Callable[[Ctx], None]:
    """Case builder: stores ``make(the shard's JSON text)`` as the shard, digest matching."""

    def build(c: Ctx) -> None:
        doc, path, entry = _sharded(c)
        with open(path, "rb") as f:
            data = f.read()
        _restore_shard(c, doc, path, entry, make(shard_text(data[entry[1]:])))

    return build


def _zstd(data: bytes, content_size: bool = True) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_content_size=content_size).compress(data)


def _global_edit(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Ctx], None]:
    def build(c: Ctx) -> None:
        doc, _, _ = _sharded(c)
        edit(doc)
        _write_global(c, doc)

    return build


@case("shard_missing", "sharded: the data file holding the only metadata shard is deleted")
def _shard_missing(c: Ctx) -> None:
    _, path, _ = _sharded(c)
    os.unlink(path)


@case("shard_truncated", "sharded: the data file is cut in the middle of its metadata shard")
def _shard_truncated(c: Ctx) -> None:
    _, path, entry = _sharded(c)
    os.truncate(path, entry[1] + entry[2] // 2)


@case("shard_bytes_flipped", "sharded: one byte inside the metadata shard is changed (its digest "
      "in pyckpt.json no longer matches)")
def _shard_flipped(c: Ctx) -> None:
    _, path, entry = _sharded(c)
    with open(path, "r+b") as f:
        f.seek(entry[1] + entry[2] // 2)
        b = f.read(1)
        f.seek(entry[1] + entry[2] // 2)
        f.write(bytes([b[0] ^ 0x01]))


case("shard_digest_lie", "sharded: pyckpt.json records another digest for the shard")(
    _global_edit(lambda d: d["shards"][0].__setitem__(3, d["shards"][0][3] ^ 1)))
case("shard_length_lie", "sharded: pyckpt.json says the shard is 1 byte shorter (so it starts "
     "1 byte later)")(_global_edit(lambda d: d["shards"][0].__setitem__(1, d["shards"][0][1] + 1)
                                   or d["shards"][0].__setitem__(2, d["shards"][0][2] - 1)))
case("shard_other_rank", "sharded: the shard says it is rank 1's (as when shards are swapped "
     "between ranks), resealed with a matching digest")(
    _reshard(lambda s: s.__setitem__("rank", 1)))
case("shard_zstd_garbage", "sharded: the shard begins like a zstd frame and is garbage after "
     "the magic, digest matching")(_restore_raw(lambda t: b"\x28\xb5\x2f\xfd" + t[4:]))
case("shard_zstd_trailing", "sharded: the shard's zstd frame is followed by more bytes, digest "
     "matching")(_restore_raw(lambda t: _zstd(t) + b"{}"))
case("shard_zstd_no_size", "sharded: the shard is a zstd frame without its content size, "
     "digest matching")(_restore_raw(lambda t: _zstd(t, content_size=False)))
case("shard_zstd_bomb", "sharded: the shard is a zstd frame of 257 MiB (about 8 KiB stored, "
     "more than a shard may hold), digest matching")(
    _restore_raw(lambda t: _zstd(t + b" " * ((257 << 20) - len(t)))))
case("shard_plain_json_other_rank", "sharded: the shard stored as plain JSON (uncompressed), "
     "saying it is rank 1's, digest matching")(
    _reshard(lambda s: s.__setitem__("rank", 1), compress=False))
case("shard_other_save", "sharded: the shard names another save id, resealed")(
    _reshard(lambda s: s.__setitem__("save_id", "0123456789ab")))
case("shard_unknown_item", "sharded: the shard holds segments of an item pyckpt.json lacks")(
    _reshard(lambda s: s["items"].__setitem__("ghost", s["items"]["w"])))
case("shard_chunk_moved", "sharded: a chunk record of 'w' points 1 byte later in the file, "
     "resealed")(_reshard(lambda s: s["items"]["w"][0][3][0].__setitem__(
         0, s["items"]["w"][0][3][0][0] + 1)))
case("shard_segment_dropped", "sharded: the shard lists 'w' with no segment (the piece is not "
     "covered), resealed")(_reshard(lambda s: s["items"].__setitem__("w", [])))
case("shard_piece_unknown", "sharded: a segment of 'w' names offsets that are no piece, "
     "resealed")(_reshard(lambda s: s["items"]["w"][0].__setitem__(0, [1, 0])))
case("shard_not_holder", "sharded: pyckpt.json names rank 5, which has no shard, as holder of "
     "'w'")(_global_edit(lambda d: d["items"]["w"].__setitem__("holders", [[5, 0, 1]])))
case("shard_grid_lie", "sharded: pyckpt.json splits 'w' in two pieces along dim 0, its shard "
     "holds one")(_global_edit(lambda d: d["items"]["w"].__setitem__("grid", [[[32, 2]], [[64, 1]]])
                               or d["items"]["w"].__setitem__("holders", [[0, 0, 2]])))
case("shard_grid_short", "sharded: the cells of 'w' add up to less than its shape")(
    _global_edit(lambda d: d["items"]["w"].__setitem__("grid", [[[32, 1]], [[64, 1]]])))
case("inline_rank_unknown", "sharded: the records of 'extra.step' (stored in pyckpt.json) name "
     "rank 7's data file, which does not exist")(
    _global_edit(lambda d: d["items"]["extra.step"]["segments"][0].__setitem__(0, 7)))
case("inline_gap", "sharded: the records of 'extra.step' start at raw byte 1")(
    _global_edit(lambda d: d["items"]["extra.step"]["segments"][0].__setitem__(1, 1)))
case("inline_chunk_in_shard", "sharded: a chunk record of 'extra.step' points into the shard")(
    _global_edit(lambda d: d["items"]["extra.step"]["segments"][0][3][0].__setitem__(
        0, d["shards"][0][1])))


# ------------------------------------------------------------------------------------ driver


def generate(root: str, names: list[str] | None = None) -> list[Case]:
    """Writes the corpus under ``root`` (which must not exist or be empty); returns its cases."""
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    base = os.path.join(root, ".baseline")
    _save_baseline(base)
    chosen = [c for c in CASES if names is None or c.name in names]
    for cs in chosen:
        cdir = os.path.join(root, "cases", cs.name)
        ckpt = os.path.join(cdir, "ckpt")
        outside = os.path.join(cdir, "outside")
        os.makedirs(outside)
        if cs.kind == "pyckpt":
            shutil.copytree(base, ckpt)
        else:
            os.makedirs(ckpt)
        cs.build(Ctx(root, cdir, ckpt, outside))
        with open(os.path.join(cdir, "DESCRIPTION"), "w") as f:
            f.write(cs.description + "\n")
        with open(os.path.join(cdir, "case.json"), "w") as f:
            json.dump({"name": cs.name, "kind": cs.kind, "description": cs.description,
                       "may_pass": list(cs.may_pass), "any_error": list(cs.any_error)}, f)
    return chosen


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: generate.py OUT_DIR\n")
        return 2
    cases = generate(argv[0])
    print(f"wrote {len(cases)} cases to {os.path.join(os.path.abspath(argv[0]), 'cases')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
