"""Validation of string options with a fixed set of values (``compression=``, ``direct_io=``...).

Every such option is matched without regard to case and surrounding blanks (``"ZSTD"``,
``" Zstd"`` and ``"zstd"`` are one value, as the ``PYCKPT_*`` environment variables already
are), and a refused value gets a message listing every accepted spelling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyckpt._format import CODEC_NONE, CODECS

__all__ = ["canonical", "choice", "compression", "direct_io"]


def _listing(accepted: Sequence[str], none_ok: bool) -> str:
    values = (["None"] if none_ok else []) + [repr(a) for a in accepted]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def canonical(value: Any, accepted: Sequence[str]) -> str | None:
    """The canonical spelling in ``accepted`` (lower case) of the string ``value``, ignoring
    case and surrounding blanks; None when ``value`` is not such a string. For options that
    also take non-string values (``True``/``False``) and raise their own message."""
    if isinstance(value, str):
        key = value.strip().lower()
        if key in accepted:
            return key
    return None


def choice(name: str, value: Any, accepted: Sequence[str], *, none_ok: bool = False) -> str | None:
    """``value`` as its canonical (lower-case) spelling among ``accepted``.

    Args:
        name: the option's name, for the message.
        value: what the caller passed.
        accepted: the canonical values, lower case.
        none_ok: ``None`` is accepted too (and returned as is).

    Raises:
        ValueError: ``value`` is none of them; the message names the option and lists every
            accepted value (matching ignores case).
    """
    if value is None and none_ok:
        return None
    key = canonical(value, accepted)
    if key is not None:
        return key
    raise ValueError(
        f"{name}={value!r} is not supported; expected {_listing(accepted, none_ok)} "
        "(any case)"
    )


def compression(value: Any) -> str | None:
    """The ``compression`` option of a writer: ``None`` (or ``"none"``) for raw, or another of
    the format's codecs (``"zstd"``); returns None or that codec."""
    key = choice("compression", value, CODECS, none_ok=True)
    return None if key == CODEC_NONE else key


def direct_io(value: Any) -> str | None:
    """The ``direct_io`` option: ``"auto"``, ``"on"``, ``"off"``; None means the default
    (``PYCKPT_DIRECT_IO``)."""
    return choice("direct_io", value, ("auto", "on", "off"), none_ok=True)
