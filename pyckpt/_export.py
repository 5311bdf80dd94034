"""Choosing what a consolidation exports: selection, renaming, dtype casts, tied-weight dedup.

Pure functions over the scanned tensor table (names, safetensors dtypes, shapes), applied by
:func:`pyckpt.consolidate` between reading the input's metadata and planning the output files.
Nothing here reads tensor data, except :func:`find_ties`, which asks its caller for a content
digest of the few candidates it compares. See ``docs/CONSOLIDATE.md``, "Choosing what to export".
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyckpt.errors import ExportNameCollisionError, UnsupportedDtypeError

__all__ = [
    "AUTO",
    "ExportNameCollisionError",
    "ExportSpec",
    "ExportChoice",
    "make_spec",
    "choose",
    "tie_candidates",
    "find_ties",
    "CAST_SOURCES",
]

logger = logging.getLogger("pyckpt.consolidate")


class _Auto:
    """Type of :data:`AUTO`, the default ``select``: see :func:`make_spec`."""

    _instance: _Auto | None = None

    def __new__(cls) -> _Auto:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self) -> str:  # pickles (to --workers processes) as the same singleton
        return "AUTO"


#: The default selection: the model alone when the checkpoint's top level holds a model and an
#: optimizer (``{"model": ..., "optim": ...}``), else every tensor.
AUTO = _Auto()

#: A ``select`` value other than AUTO / None.
Selector = (
    str | re.Pattern[str] | Callable[[str], bool] | Sequence[str | re.Pattern[str]]
)
Renamer = Mapping[str, str] | Callable[[str], str]

#: Top-level keys that mark an optimizer next to a ``model`` key.
_OPTIM_KEYS = ("optim", "optimizer")

#: Names of input embeddings, the copy of a tie that is kept: ``*embed*`` (Llama's
#: ``model.embed_tokens``, BERT's ``word_embeddings``, GPT-NeoX's ``embed_in``), GPT-2's ``wte``
#: and T5's ``shared``.
_EMBEDDING = re.compile(r"embed|(^|\.)(wte|shared)\.")

#: Floating safetensors dtypes a cast converts (others, like float8, are exported unchanged).
CAST_SOURCES = frozenset(("F64", "F32", "F16", "BF16"))

_DTYPE_NAMES = {
    "bf16": "BF16", "bfloat16": "BF16",
    "fp16": "F16", "f16": "F16", "float16": "F16", "half": "F16",
    "fp32": "F32", "f32": "F32", "float32": "F32", "float": "F32",
}


@dataclass(frozen=True)
class ExportSpec:
    """The user's choices, validated (see :func:`make_spec`)."""

    select: Any = AUTO  # AUTO, None (everything) or a predicate
    select_text: str = ""  # how the selection reads in messages
    strip: tuple[str, ...] = ()
    rename: Renamer | None = None
    dtype: str | None = None  # safetensors spelling of the cast target
    dedup_tied: bool | Mapping[str, str] = False


@dataclass
class ExportChoice:
    """What :func:`choose` decided.

    Attributes:
        names: output name -> source name, for every exported tensor.
        casts: output name -> (source dtype, target dtype), for the tensors converted on the way.
        skipped: source names left out because safetensors cannot hold their dtype.
        description: one line saying what was selected and how to get everything.
        ties: output name dropped -> output name kept (filled by :func:`find_ties`).
    """

    names: dict[str, str]
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    description: str = ""
    ties: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- arguments


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    text = str(dtype)  # torch.bfloat16 -> "torch.bfloat16", without importing torch here
    key = text.removeprefix("torch.")
    if key in ("BF16", "F16", "F32"):
        return key
    name = _DTYPE_NAMES.get(key.lower())
    if name is None:
        raise ValueError(
            f"dtype must be bf16, fp16 or fp32 (or torch.bfloat16 / float16 / float32), got {dtype!r}"
        )
    return name


def _prefixes(value: str | Sequence[str] | None, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    for p in items:
        if not isinstance(p, str) or not p:
            raise ValueError(f"{what} entries must be non-empty strings, got {p!r}")
    return tuple(items)


def _predicate(select: Any) -> tuple[Callable[[str], bool], str]:
    """A name predicate and its description for prefixes, patterns, mixed lists or a callable."""
    if isinstance(select, (str, re.Pattern)):
        select = [select]
    if callable(select) and not isinstance(select, (list, tuple)):
        fn = select
        return (lambda n: bool(fn(n))), f"names accepted by {getattr(fn, '__name__', 'select')}"
    if not isinstance(select, (list, tuple)) or not select:
        raise ValueError(
            "select must be a prefix, a list of prefixes, a compiled regex, a callable, None "
            f"(everything) or left at its default, got {select!r}"
        )
    prefixes: list[str] = []
    patterns: list[re.Pattern[str]] = []
    for s in select:
        if isinstance(s, re.Pattern):
            patterns.append(s)
        elif isinstance(s, str) and s:
            prefixes.append(s)
        else:
            raise ValueError(f"select entries must be non-empty prefixes or compiled regexes, got {s!r}")
    pre = tuple(prefixes)

    def pred(n: str) -> bool:
        return n.startswith(pre) or any(p.search(n) for p in patterns)

    parts = [f"names starting with {p!r}" for p in pre] + [
        f"names matching /{p.pattern}/" for p in patterns
    ]
    return pred, " or ".join(parts)


def make_spec(
    select: Any = AUTO,
    strip_prefix: str | Sequence[str] | None = None,
    rename: Renamer | None = None,
    dtype: Any = None,
    dedup_tied: bool | Mapping[str, str] = False,
) -> ExportSpec:
    """Validates the export arguments of :func:`pyckpt.consolidate`.

    Args:
        select: :data:`AUTO` (the default: the model alone for a ``{"model", "optim"}``
            checkpoint, stripped of ``model.``; else everything), ``None`` (every tensor), a
            prefix, a compiled regex (``re.search``), a list of prefixes and regexes (a name is
            taken if any matches) or a callable ``(name) -> bool``.
        strip_prefix: a prefix or prefixes removed from the start of the selected names (the
            longest that matches; a name equal to a prefix is kept whole).
        rename: ``{old_prefix: new_prefix}`` (the longest matching prefix is replaced), or a
            callable ``(name) -> new name``; applied after ``strip_prefix``.
        dtype: cast floating tensors (F64, F32, F16, BF16) to ``bf16`` / ``fp16`` / ``fp32``
            (strings or ``torch.bfloat16`` etc.); other dtypes are exported unchanged.
        dedup_tied: ``True`` writes a tied output head once (see :func:`tie_candidates`); a
            mapping ``{dropped_name: kept_name}`` (output names) names the ties explicitly.

    Returns:
        An :class:`ExportSpec`.

    Raises:
        ValueError: an argument of the wrong form.
    """
    pred: Any
    if select is AUTO or select is None:
        pred, text = select, ("automatic" if select is AUTO else "every tensor")
    else:
        pred, text = _predicate(select)
    if rename is not None and not callable(rename):
        if not isinstance(rename, Mapping):
            raise ValueError(f"rename must be a mapping of prefixes or a callable, got {rename!r}")
        for old, new in rename.items():
            if not isinstance(old, str) or not old or not isinstance(new, str):
                raise ValueError(f"rename maps non-empty prefixes to strings, got {old!r}: {new!r}")
        rename = dict(rename)
    if not isinstance(dedup_tied, bool):
        if not isinstance(dedup_tied, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and k != v for k, v in dedup_tied.items()
        ):
            raise ValueError(
                f"dedup_tied must be a bool or a mapping of dropped -> kept names, got {dedup_tied!r}"
            )
        dedup_tied = dict(dedup_tied)
    return ExportSpec(
        select=pred,
        select_text=text,
        strip=_prefixes(strip_prefix, "strip_prefix"),
        rename=rename,
        dtype=_dtype_name(dtype),
        dedup_tied=dedup_tied,
    )


# --------------------------------------------------------------------------- choosing


def top_level_layout(names: Iterable[str]) -> str | None:
    """The optimizer key when the top level holds ``model`` and ``optim`` / ``optimizer``.

    Args:
        names: every item name of the checkpoint (tensors and non-tensor values).

    Returns:
        ``"optim"`` or ``"optimizer"``, or None when the layout is something else.
    """
    tops = {n.split(".", 1)[0] for n in names if "." in n}
    if "model" not in tops:
        return None
    for key in _OPTIM_KEYS:
        if key in tops:
            return key
    return None


def _longest(name: str, prefixes: Iterable[str]) -> str | None:
    best = None
    for p in prefixes:
        if name.startswith(p) and len(name) > len(p) and (best is None or len(p) > len(best)):
            best = p
    return best


def _out_name(name: str, spec: ExportSpec, strip: tuple[str, ...]) -> str:
    p = _longest(name, strip)
    if p is not None:
        name = name[len(p):]
    if spec.rename is None:
        return name
    if callable(spec.rename):
        new = spec.rename(name)
        if not isinstance(new, str) or not new:
            raise ValueError(f"rename({name!r}) returned {new!r}, not a non-empty name")
        return new
    p = _longest(name, spec.rename) if name not in spec.rename else name
    if p is None:
        return name
    new = spec.rename[p] + name[len(p):]
    if not new:
        raise ValueError(f"rename maps {name!r} to {new!r}, not a non-empty name")
    return new


def choose(
    spec: ExportSpec,
    dtypes: Mapping[str, str],
    unsupported: Mapping[str, str] | None = None,
    other_names: Iterable[str] = (),
) -> ExportChoice:
    """Applies selection, renaming and the cast plan to a scanned tensor table.

    Args:
        spec: from :func:`make_spec`.
        dtypes: source tensor name -> safetensors dtype, for every tensor safetensors can hold.
        unsupported: source tensor name -> dtype (torch spelling) safetensors cannot hold.
        other_names: the names of non-tensor items, used only to recognise the top-level layout.

    Returns:
        An :class:`ExportChoice` (no ties yet).

    Raises:
        UnsupportedDtypeError: an explicitly selected tensor (or any tensor with ``select=None``)
            whose dtype safetensors cannot hold; names it.
        ExportNameCollisionError: two selected tensors get one output name; names both.
        ValueError: nothing is selected, or a renaming produced an empty name.
    """
    unsupported = dict(unsupported or {})
    everything = sorted([*dtypes, *unsupported])
    strip = spec.strip
    explicit = spec.select is not AUTO
    if spec.select is AUTO:
        optim = top_level_layout([*everything, *other_names])
        if optim is not None:
            taken = [n for n in everything if n.startswith("model.")]
            strip = strip or ("model.",)
            description = (
                f"exporting the model: {len(taken)} tensors under 'model.' (named without "
                f"'model.'), leaving out '{optim}' and every other top-level key; pass "
                "select=None (`--all`) to export every tensor"
            )
        else:
            taken = everything
            description = f"exporting every tensor ({len(taken)})"
    elif spec.select is None:
        taken = everything
        description = f"exporting every tensor ({len(taken)}), as select=None asks"
    else:
        taken = [n for n in everything if spec.select(n)]
        description = f"exporting {len(taken)} of {len(everything)} tensors: {spec.select_text}"

    bad = [n for n in taken if n in unsupported]
    if bad and explicit:
        listed = ", ".join(f"{n!r} ({unsupported[n]})" for n in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise UnsupportedDtypeError(
            f"selected tensor(s) {listed}{more} have a dtype safetensors cannot represent; "
            "leave them out of select"
        )
    # Left unselected, or taken only by the automatic choice: skipped (said so below, once the
    # rest of the choice has proved valid).
    skipped = sorted(unsupported)
    taken = [n for n in taken if n not in unsupported]
    if not taken:
        raise ValueError(
            f"nothing to export: the selection ({spec.select_text}) matches none of the "
            f"{len(everything)} tensors (first names: {everything[:5]})"
        )

    names: dict[str, str] = {}
    for src in taken:
        out = _out_name(src, spec, strip)
        first = names.get(out)
        if first is not None:
            raise ExportNameCollisionError(out, (first, src))
        names[out] = src
    casts: dict[str, tuple[str, str]] = {}
    if spec.dtype is not None:
        for out, src in names.items():
            d = dtypes[src]
            if d in CAST_SOURCES and d != spec.dtype:
                casts[out] = (d, spec.dtype)
        description += f"; floating tensors cast to {spec.dtype} ({len(casts)} converted)"
    if skipped:
        description += f"; {len(skipped)} tensor(s) skipped (dtype safetensors cannot hold)"
        listed = ", ".join(f"{n!r} ({unsupported[n]})" for n in skipped[:10])
        more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        warnings.warn(
            f"consolidate: skipping {len(skipped)} tensor(s) whose dtype safetensors cannot "
            f"represent: {listed}{more}",
            UserWarning,
            stacklevel=2,
        )
    logger.info("consolidate: %s", description)
    return ExportChoice(names=names, casts=casts, skipped=skipped, description=description)


# --------------------------------------------------------------------------- tied weights


def tie_candidates(
    choice: ExportChoice,
    spec: ExportSpec,
    dtypes: Mapping[str, str],
    shapes: Mapping[str, tuple[int, ...]],
) -> list[tuple[str, str]]:
    """Pairs (duplicate, kept) of output names whose contents :func:`find_ties` compares.

    With ``dedup_tied=True``: every 2-D tensor whose name is not an input embedding's, paired
    with each 2-D input embedding of the same source dtype and shape (an output head tied to
    the input embedding, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``, BERT's
    ``cls.predictions.decoder.weight`` and ``bert.embeddings.word_embeddings.weight``, GPT-2's
    ``lm_head.weight`` and ``transformer.wte.weight``). Input embeddings are the names that
    contain ``embed`` or a ``wte.`` / ``shared.`` component.
    The embedding is the copy kept, as ``transformers``' ``save_pretrained`` does. Tensors that
    are merely equal (layer norms still at their initial ones, zero biases) are never candidates:
    they are not 2-D embedding-shaped pairs.

    With a mapping: its pairs, checked to name exported tensors of one dtype and shape.

    Raises:
        ValueError: a mapping names a tensor that is not exported, or pairs unlike tensors.
    """
    if spec.dedup_tied is False:
        return []

    def key(out: str) -> tuple[str, tuple[int, ...]]:
        src = choice.names[out]
        return dtypes[src], tuple(shapes[src])

    if isinstance(spec.dedup_tied, Mapping):
        pairs = []
        for dropped, kept in sorted(spec.dedup_tied.items()):
            for n in (dropped, kept):
                if n not in choice.names:
                    raise ValueError(f"dedup_tied names {n!r}, which is not exported")
            if key(dropped) != key(kept):
                raise ValueError(
                    f"dedup_tied pairs {dropped!r} {key(dropped)} with {kept!r} {key(kept)}: "
                    "dtype or shape differ"
                )
            if kept in spec.dedup_tied:
                raise ValueError(f"dedup_tied keeps {kept!r} but also drops it")
            pairs.append((dropped, kept))
        return pairs
    embeds: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for out in sorted(choice.names):
        if _EMBEDDING.search(out) and len(shapes[choice.names[out]]) == 2:
            embeds.setdefault(key(out), []).append(out)
    pairs = []
    for out in sorted(choice.names):
        if _EMBEDDING.search(out) or len(shapes[choice.names[out]]) != 2:
            continue
        for kept in embeds.get(key(out), []):
            pairs.append((out, kept))
    return pairs


def find_ties(
    choice: ExportChoice,
    pairs: Sequence[tuple[str, str]],
    digest: Callable[[str], bytes],
    explicit: bool,
) -> dict[str, str]:
    """Compares each candidate pair's contents; records and returns the ties found.

    Args:
        choice: from :func:`choose`; ``choice.ties`` is filled in.
        pairs: from :func:`tie_candidates`.
        digest: source tensor name -> digest of its full row-major bytes (called at most once
            per tensor).
        explicit: the pairs were named by the user: a pair whose contents differ is an error.

    Returns:
        ``choice.ties``: dropped output name -> kept output name.

    Raises:
        ValueError: an explicitly named pair whose contents differ.
    """
    cache: dict[str, bytes] = {}

    def get(out: str) -> bytes:
        src = choice.names[out]
        if src not in cache:
            cache[src] = digest(src)
        return cache[src]

    for dropped, kept in pairs:
        if dropped in choice.ties:
            continue
        if get(dropped) == get(kept):
            choice.ties[dropped] = kept
        elif explicit:
            raise ValueError(
                f"dedup_tied: {dropped!r} and {kept!r} differ in content; they are not tied"
            )
    if choice.ties:
        logger.info(
            "consolidate: writing tied weights once: %s",
            ", ".join(f"{d} (= {k})" for d, k in sorted(choice.ties.items())),
        )
        choice.description += "; tied weights written once: " + ", ".join(
            f"{d} = {k}" for d, k in sorted(choice.ties.items())
        )
    return choice.ties
