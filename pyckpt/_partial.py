"""Partial loads: stored entries a load leaves behind under a key the state dict holds.

DCP loads exactly the keys the state dict asks for. A fresh optimizer's ``state_dict()`` has
an empty ``state`` (Adam creates its moments on the first step), so ``{"model": ...,
"optim": optim.state_dict()}`` asks for the learning rates in ``optim.param_groups`` and for no
moment at all: the load succeeds, the moments stay unloaded, and the resumed training diverges
without a word. The same happens to any sub-dict the destination holds but has not filled yet.

The rule: a stored entry that no rank asks for is *left behind* when the destination holds a
key above it, i.e. some requested key shares a dotted prefix with it (``optim.state.0.exp_avg``
is left behind when ``optim.param_groups`` is requested), or shares its first component with a
top-level key of the destination (``loader.pos`` is left behind when the destination holds
``loader`` as an empty dict, or as a ``Stateful`` whose ``state_dict()`` is still empty: such a
key asks for nothing, yet it is held). Entries under keys the destination does not hold at all
(loading only ``model`` from a ``{model, optim}`` checkpoint) are a deliberate selection and are
not reported. The top-level keys come from :class:`pyckpt.LoadPlanner` (``pyckpt.load``,
``CheckpointManager.restore``, ``dcp.load(..., planner=pyckpt.LoadPlanner())``); with DCP's
``DefaultLoadPlanner`` only the prefixes of requested keys count as held. Stored tensors with
no elements are never read and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["left_behind", "message"]


def _prefixes(key: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b"]`` (the proper dotted prefixes, shortest first)."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def left_behind(stored: Iterable[str], requested: Iterable[str],
                top_level: Iterable[str] = ()) -> dict[str, list[str]]:
    """Stored keys that are not requested although the destination holds a key above them (a
    proper prefix of a requested key, or one of ``top_level``: the destination's top-level
    keys, where known), grouped by the key one level below the deepest such prefix
    (``{"optim.state": ["optim.state.0.exp_avg", ...]}``); lists sorted. Empty: nothing left
    behind. O(total key length)."""
    wanted = set(requested)
    held: set[str] = set(top_level)
    for key in wanted:
        held.update(_prefixes(key))
    groups: dict[str, list[str]] = {}
    for key in stored:
        if key in wanted:
            continue
        parts = key.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in held:
                groups.setdefault(".".join(parts[: i + 1]), []).append(key)
                break
    return {g: sorted(keys) for g, keys in sorted(groups.items())}


def message(path: str, groups: dict[str, list[str]], raising: bool) -> str:
    """What a partial load says: the keys, an example of each, and the fix."""
    listed = "; ".join(
        f"{g!r}: {len(keys)} stored entr{'y' if len(keys) == 1 else 'ies'} (e.g. {keys[0]!r})"
        for g, keys in list(groups.items())[:5])
    if len(groups) > 5:
        listed += f"; and {len(groups) - 5} more keys"
    outcome = "nothing was loaded" if raising else "they were not loaded"
    optimizer = any(g == "state" or g.endswith(".state") for g in groups)
    hint = (
        "An optimizer's state_dict() has no 'state' entries before its first step, so a "
        "resumed optimizer would start from zero: build the state with "
        "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) and apply it "
        "after loading with set_state_dict(...), or pass the model and optimizer themselves to "
        "pyckpt.save/load or pyckpt.CheckpointManager.save/restore ({'model': model, 'optim': "
        "optim}). " if optimizer else
        "Add those keys to the state dict to load them. ")
    return (
        f"pyckpt: the checkpoint {path} holds entries the state dict being loaded does not ask "
        f"for, under keys it holds: {listed}; {outcome}. {hint}"
        + ("Pass allow_partial=True to load only what the state dict asks for."
           if raising else "pyckpt.load raises here unless allow_partial=True.")
    )
