"""Walking a parsed JSON document (the metadata fuzzers' and mutation tests' helpers)."""

from __future__ import annotations

from typing import Any


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path of ``node``, the root's ``()`` first (dict keys and list indexes)."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, prefix + (i,))
    return out


def get(doc: Any, path: tuple[Any, ...]) -> Any:
    """The value at key path ``path`` of ``doc``."""
    for k in path:
        doc = doc[k]
    return doc
