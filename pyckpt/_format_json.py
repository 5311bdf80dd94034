"""On-disk format, small pieces of the strict schema (:mod:`pyckpt._format_schema`): the marker
of a JSON object that repeats a key, value descriptions and key paths spelled out only when an
error message needs them, the tagged-tuple hook, and the field lists the native reader builds
index entries from."""

from __future__ import annotations

import dataclasses
from typing import Any

from pyckpt._format_spec import _JUST_INT, MAX_NUMEL, StoredPiece, StoredTensor

__all__ = ["_Duplicate", "_describe", "_member", "_dims_ok", "_fields", "_untuple", "_Path",
           "_Key", "_TENSOR_FIELDS", "_PIECE_FIELDS"]


class _Duplicate:
    """Stands for a JSON object that repeats a key (reported with its key path later)."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


def _describe(value: Any) -> str:
    if isinstance(value, _Duplicate):
        return f"an object that repeats the key {value.key!r}"
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _member(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _dims_ok(dims: list[Any]) -> bool:
    """Every entry an exact int (not a bool) in [0, MAX_NUMEL]: the common case, checked with
    C-level loops (the validator's per-entry loop then only runs to report a failure)."""
    return not dims or (set(map(type, dims)) == _JUST_INT and min(dims) >= 0
                        and max(dims) <= MAX_NUMEL)


def _fields(cls: type) -> tuple[type, tuple[str, ...]]:
    """(cls, its field names in order): how the native reader makes instances without __init__
    (see ``_C.PyckptIndex.materialize``), which only holds for a plain slots dataclass."""
    if "__post_init__" in vars(cls) or not hasattr(cls, "__slots__"):
        raise TypeError(f"{cls.__name__} must stay a plain slots dataclass")
    return cls, tuple(f.name for f in dataclasses.fields(cls))


_TENSOR_FIELDS = _fields(StoredTensor)
_PIECE_FIELDS = _fields(StoredPiece)


def _untuple(obj: dict[str, Any]) -> Any:
    """``json.loads`` object hook: a tagged tuple ``{"__tuple__": [...]}`` becomes a tuple (the
    native reader checked that such objects have that key alone, holding a list)."""
    return tuple(obj["__tuple__"]) if "__tuple__" in obj else obj


class _Path:
    """A key path spelled out only when a message needs it: ``{base}{member}[{n}]`` (no index
    when ``n`` is None)."""

    __slots__ = ("base", "member", "n")

    def __init__(self, base: object, member: str, n: int | None = None) -> None:
        self.base, self.member, self.n = base, member, n

    def __str__(self) -> str:
        if self.n is None:
            return f"{self.base}{self.member}"
        return f"{self.base}{self.member}[{self.n}]"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _Key:
    """A key path spelled out only when a message needs it: ``{base}[{key!r}]``."""

    __slots__ = ("base", "key")

    def __init__(self, base: object, key: str) -> None:
        self.base, self.key = base, key

    def __str__(self) -> str:
        return f"{self.base}[{self.key!r}]"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)
