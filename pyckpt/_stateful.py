"""Modules, optimizers and other ``Stateful`` objects in a state to save or restore.

DCP calls ``state_dict()`` / ``load_state_dict()`` on the ``Stateful`` values of a state. For an
optimizer that is the wrong pair: its ``state_dict()`` is keyed by parameter number and, before
the first step, has no ``state`` at all, so a resume through it loads no moments (see
:mod:`pyckpt._partial`). Here models and optimizers go through
``torch.distributed.checkpoint.state_dict`` instead, which keys the optimizer's state by
parameter name (so it reshards with the model) and creates a fresh optimizer's state before it
is loaded into: :func:`to_save` gives what to save, :func:`to_load` what to load into and the
call that applies it afterwards.

Every optimizer is paired with the module of the state that holds all its parameters.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["FreshOptimizerState", "has_objects", "optimizer_state", "set_optimizer_state",
           "to_save", "to_load"]


def has_objects(state: Any) -> bool:
    """Whether ``state`` (a mapping) holds a module, an optimizer, a ``torch.Generator`` or
    another ``Stateful``."""
    return isinstance(state, Mapping) and any(
        isinstance(v, (torch.nn.Module, torch.optim.Optimizer, torch.Generator, Stateful))
        for v in state.values())


def _owner(key: str, optim: torch.optim.Optimizer,
           modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    params = {id(p) for group in optim.param_groups for p in group["params"]}
    owners = [m for m in modules.values() if params <= {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        raise ValueError(
            f"state[{key!r}] is an optimizer, and {len(owners)} of the state's modules "
            f"({sorted(modules)}) hold all its parameters: pass exactly one model with it, or "
            "pass state dicts made with torch.distributed.checkpoint.state_dict.get_state_dict")
    return owners[0]


def _refuse_nested(value: Any, path: str) -> None:
    """Raises ``TypeError`` for a module or optimizer below the top level of a state: DCP would
    pickle it whole, a pickle a load refuses (weights-only) or, trusted, puts in place of the
    object instead of loading into it."""
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return
    for key, v in items:
        where = f"{path}[{key!r}]"
        if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
            raise TypeError(
                f"{where} is a {type(v).__name__}: modules and optimizers are saved and loaded "
                "as top-level values of the state only ({'model': model, 'optim': optim}); "
                "below the top level pass their state dicts (get_state_dict)")
        if not isinstance(v, torch.Tensor):
            _refuse_nested(v, where)


def _objects_on_top(state: Any) -> bool:
    """:func:`has_objects`, after refusing a module or optimizer nested deeper."""
    if isinstance(state, Mapping):
        for key, value in state.items():
            if not isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
                _refuse_nested(value, f"state[{key!r}]")
    return has_objects(state)


def to_save(state: Any, fresh_moments: bool = False) -> Any:
    """``state`` with every module, optimizer and ``Stateful`` value replaced by its state dict
    (models and optimizers through ``get_model_state_dict`` / :func:`optimizer_state`, which
    leaves an optimizer that has not stepped as it was); ``state`` itself when it holds none.
    ``fresh_moments``: such an optimizer's moments made for a load (:func:`to_load`).
    A module or optimizer nested deeper is refused (``TypeError`` naming it)."""
    if not _objects_on_top(state):
        return state
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[key] = optimizer_state(_owner(key, value, modules), value, fresh_moments)
        elif isinstance(value, torch.Generator):  # its state (a tensor), set back in place
            out[key] = value.get_state()
        elif isinstance(value, Stateful):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


@contextlib.contextmanager
def _no_step_hooks(optim: torch.optim.Optimizer, fresh: bool) -> Iterator[None]:
    """The optimizer's own step hooks (``register_step_pre_hook`` / ``register_step_post_hook``,
    e.g. an EMA update) set aside while torch makes a ``fresh`` optimizer's state by its step
    at lr 0: that step is not one of the training's."""
    if not fresh:
        yield
        return
    pre, post = optim._optimizer_step_pre_hooks, optim._optimizer_step_post_hooks
    optim._optimizer_step_pre_hooks, optim._optimizer_step_post_hooks = (
        collections.OrderedDict(), collections.OrderedDict())
    try:
        yield
    finally:
        optim._optimizer_step_pre_hooks, optim._optimizer_step_post_hooks = pre, post


def optimizer_state(owner: torch.nn.Module, optim: torch.optim.Optimizer,
                    fresh_moments: bool = False,
                    options: StateDictOptions | None = None) -> dict[str, Any]:
    """``get_optimizer_state_dict(owner, optim)`` without its side effect on an optimizer that
    has not stepped: torch makes that optimizer's state by a step at lr 0, so Adam's step count
    would start at 1 before the first real step and the training differ from one without the
    save. That state is dropped again and the result holds none, as ``optim.state_dict()``
    does; ``fresh_moments``: the result keeps them (what a load fills,
    :class:`FreshOptimizerState`), the optimizer still not: a load that fails or finds no
    checkpoint (``restore()`` of a job's first run) leaves it as it was. Gradients already
    there (a warm-up backward before the load) are set aside meanwhile: torch makes no state
    when it finds one, and the load would ask for no moment.
    ``options``: as for ``get_optimizer_state_dict``."""
    fresh = not optim.state
    params = [p for group in optim.param_groups for p in group["params"]]
    grads = [p.grad for p in params] if fresh and fresh_moments else []
    try:
        for p in params if grads else ():
            p.grad = None
        with _no_step_hooks(optim, fresh):
            state = get_optimizer_state_dict(owner, optim, options=options)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    if fresh and optim.state:
        optim.state.clear()  # the moments stay in ``state`` alone (a load fills them there)
        if not fresh_moments:
            state["state"] = {}
    return FreshOptimizerState(state) if fresh_moments and fresh else state


class FreshOptimizerState(dict[str, Any]):
    """The state dict a fresh optimizer loads into: its moments made for every parameter by
    ``get_optimizer_state_dict``. :class:`pyckpt.LoadPlanner` asks for no moments of a
    parameter the checkpoint holds none of (an optimizer saved before its first step, or a
    parameter that never had a gradient) and names those in ``absent``; :func:`to_load` then
    leaves them without state, as in the run that saved."""

    absent: frozenset[str] = frozenset()

    def unheld(self, key: str, stored: Mapping[str, Any]) -> dict[str, list[str]]:
        """The flattened keys of the moments of each parameter whose moments ``stored`` (a
        checkpoint's ``state_dict_metadata``) holds none of, this being the state under
        top-level ``key``; records those parameters in ``absent``."""
        out = {fqn: [f"{key}.state.{fqn}.{name}" for name in moments]
               for fqn, moments in self.get("state", {}).items()}
        out = {fqn: flat for fqn, flat in out.items() if not any(k in stored for k in flat)}
        self.absent = frozenset(out)
        return out


def to_load(state: Any) -> tuple[Any, Callable[[], None]]:
    """What to load ``state`` into, and the call that applies the loaded values to its modules,
    optimizers and ``Stateful`` objects and puts its other top-level values back into
    ``state`` (call it after the load). A fresh optimizer's state is
    created here (by ``get_optimizer_state_dict``), so the load asks for every moment the
    checkpoint holds (see :class:`FreshOptimizerState`)."""
    if not _objects_on_top(state):
        return state, lambda: None
    dest = to_save(state, fresh_moments=True)

    def apply() -> None:
        modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
        # Models first: an optimizer's state is set by the names of its model's parameters.
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                set_model_state_dict(value, dest[key])
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                set_optimizer_state(_owner(key, value, modules), value, dest[key])
            elif isinstance(value, torch.Generator):
                value.set_state(dest[key])
            elif isinstance(value, Stateful) and not isinstance(value, torch.nn.Module):
                value.load_state_dict(dest[key])
            elif not isinstance(value, torch.nn.Module):
                state[key] = dest[key]  # a value DCP replaced (an int, a string)

    return dest, apply


def set_optimizer_state(owner: torch.nn.Module, optim: torch.optim.Optimizer, loaded: Any,
                        options: StateDictOptions | None = None) -> None:
    """``set_optimizer_state_dict(owner, optim, loaded)``; for a :class:`FreshOptimizerState`,
    the parameters whose moments the checkpoint did not hold are left without state."""
    if isinstance(loaded, FreshOptimizerState) and loaded.absent:
        loaded = {**loaded, "state": {fqn: m for fqn, m in loaded["state"].items()
                                      if fqn not in loaded.absent}}
        options = dataclasses.replace(options or StateDictOptions(), strict=False)
    with _no_step_hooks(optim, not optim.state):
        set_optimizer_state_dict(owner, optim, loaded, options=options)
