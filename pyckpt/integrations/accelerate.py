"""Hugging Face Accelerate checkpoints through pyckpt (``pip install pyckpt[accelerate]``).

    accelerator = Accelerator(...)
    model, optim = accelerator.prepare(model, optim)
    handle = pyckpt.integrations.accelerate.install(accelerator, compression="zstd")
    accelerator.save_state("ckpt/step-100")      # model and optimizer through pyckpt
    accelerator.load_state("ckpt/step-100")
    handle.uninstall()                           # accelerate's own files again

Accelerate has no storage-writer option: ``save_state`` with FSDP ``SHARDED_STATE_DICT`` calls
``save_fsdp_model`` / ``save_fsdp_optimizer``, which hard-code DCP's ``FileSystemWriter``
(``load_fsdp_*`` its ``FileSystemReader``), and without FSDP ``save_accelerator_state`` writes
``model.safetensors`` and ``optimizer.bin`` from the main process. Those functions are looked up
by name in the modules that imported them (``accelerate.accelerator``, ``accelerate.utils``,
``transformers.trainer``, ...). :func:`install` replaces each of them, in every loaded module that
holds it, by a dispatcher that runs pyckpt's version for the accelerators installed and
accelerate's own function for every other one; the last :meth:`Installation.uninstall` puts the
originals back.

What goes through pyckpt (:class:`pyckpt.Writer` / :class:`pyckpt.Reader`, with
:class:`pyckpt.SavePlanner` / :class:`pyckpt.LoadPlanner`):

* FSDP (1 or 2) with ``SHARDED_STATE_DICT``: each model and optimizer is one pyckpt checkpoint in
  accelerate's folders (``pytorch_model_fsdp_<i>/``, ``optimizer_<i>/``), holding the same keys
  as accelerate's DCP checkpoints (``model``, ``optimizer``). The HF ``Trainer``'s FSDP
  checkpoints call the same functions, so they follow for its accelerator.
* Without FSDP or DeepSpeed (one process, DDP): the models' weights and the optimizers are one
  pyckpt checkpoint, ``pyckpt_state/`` (keys ``model``, ``model_1``, ..., ``optimizer``,
  ``optimizer_1``, ...), written by all ranks (replicated DDP state is spread over them by
  bytes). Optimizers are keyed by parameter name (``get_optimizer_state_dict``), so a fresh
  optimizer loads its moments. Schedulers, samplers, the scaler, the RNG states and custom
  objects stay accelerate's files. ``install(..., non_fsdp=False)`` leaves this path to
  accelerate.

A load reads pyckpt's checkpoint where the folder holds one and hands the folder to accelerate
otherwise, so checkpoints written before :func:`install` still load. Other paths
(``FULL_STATE_DICT``, ``LOCAL_STATE_DICT``, ``use_dcp=False``, DeepSpeed, Megatron-LM, XLA) stay
accelerate's.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import accelerate
    import accelerate.checkpointing as _checkpointing
    import accelerate.utils.fsdp_utils as _fsdp_utils
    from accelerate.utils import DistributedType
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "pyckpt.integrations.accelerate needs Hugging Face Accelerate: "
        "pip install pyckpt[accelerate]"
    ) from exc

import torch
from packaging.version import Version

import pyckpt
from pyckpt import _stateful

__all__ = ["install", "Installation", "UntestedVersionWarning", "TESTED_VERSIONS",
           "STATE_DIR"]

#: The accelerate releases this module was tested with (the ``accelerate`` extra's range).
TESTED_VERSIONS = ">=1.15,<1.16"
_TESTED = (Version("1.15"), Version("1.16"))

#: The folder (inside ``save_state``'s ``output_dir``) of the non-FSDP models and optimizers.
STATE_DIR = "pyckpt_state"

_METADATA = "pyckpt.json"


class UntestedVersionWarning(UserWarning):
    """The installed accelerate is outside the range this integration was tested with."""


_version_warned = False


def _check_version() -> None:
    global _version_warned
    version = Version(accelerate.__version__)
    if _version_warned or _TESTED[0] <= version < _TESTED[1]:
        return
    _version_warned = True
    warnings.warn(
        f"pyckpt.integrations.accelerate was tested with accelerate {TESTED_VERSIONS}, "
        f"found {accelerate.__version__}: it replaces accelerate's checkpoint functions, whose "
        "signatures may have changed", UntestedVersionWarning, stacklevel=3)


class Installation:
    """What :func:`install` returns: pyckpt handles ``accelerator``'s checkpoints until
    :meth:`uninstall` (or the end of a ``with`` block).

    Attributes:
        accelerator: the accelerator whose checkpoints go through pyckpt.
        writer_options: passed to :class:`pyckpt.Writer` (through :func:`pyckpt.save`).
        trusted: non-tensor values are unpickled with ``weights_only=False`` on load.
        non_fsdp: whether saves without FSDP go through pyckpt too.
    """

    def __init__(self, accelerator: Any, writer_options: dict[str, Any], trusted: bool,
                 non_fsdp: bool) -> None:
        self._accelerator = weakref.ref(accelerator)
        self.writer_options = writer_options
        self.trusted = trusted
        self.non_fsdp = non_fsdp
        self._wrapped: dict[str, Any] = {}  # method name -> the instance attribute it replaced

    @property
    def accelerator(self) -> Any:
        return self._accelerator()

    @property
    def active(self) -> bool:
        """Whether this installation still routes the accelerator's checkpoints."""
        acc = self.accelerator
        return acc is not None and _installs.get(acc) is self

    def uninstall(self) -> None:
        """Gives the accelerator's checkpoints back to accelerate (idempotent); the last one
        restores accelerate's functions in every module they were replaced in."""
        with _lock:
            acc = self.accelerator
            if acc is None or _installs.get(acc) is not self:
                return
            del _installs[acc]
            for name, previous in self._wrapped.items():
                if previous is None:
                    vars(acc).pop(name, None)
                else:
                    setattr(acc, name, previous)
            self._wrapped.clear()
            if not _installs:
                _unpatch()

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ---- the pyckpt side -------------------------------------------------------------------

    def save(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        pyckpt.save(state, path, **self.writer_options)

    def load(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        pyckpt.load(state, path, trusted=self.trusted)


_lock = threading.Lock()
_installs: weakref.WeakKeyDictionary[Any, Installation] = weakref.WeakKeyDictionary()
# The installation whose save_state / load_state runs in this thread or task: accelerate's
# save_accelerator_state is not told which accelerator calls it.
_current: contextvars.ContextVar[Installation | None] = contextvars.ContextVar(
    "pyckpt_accelerate_current", default=None)


def install(accelerator: Any, compression: str | None = "zstd", *, non_fsdp: bool = True,
            trusted: bool = False, **writer_options: Any) -> Installation:
    """Routes ``accelerator.save_state`` / ``load_state`` (and the HF ``Trainer``'s FSDP
    checkpoints of that accelerator) through pyckpt.

    Args:
        accelerator: an ``accelerate.Accelerator``; other accelerators are not affected.
        compression: as for :class:`pyckpt.Writer` (``"zstd"`` or ``None``).
        non_fsdp: also save the models and optimizers of a run without FSDP or DeepSpeed (one
            process, DDP) as one pyckpt checkpoint (``pyckpt_state/``); False leaves them to
            accelerate's ``model.safetensors`` / ``optimizer.bin``.
        trusted: unpickle stored non-tensor values with ``weights_only=False`` on load (see
            :func:`pyckpt.load`).
        **writer_options: further :class:`pyckpt.Writer` options (``threads``, ``fsync``,
            ``overwrite``, ``direct_io``, ...).

    Returns:
        An :class:`Installation`; its :meth:`~Installation.uninstall` (or leaving its ``with``
        block) undoes this.

    Raises:
        ValueError: invalid writer options, or ``accelerator`` already installed.

    Warns:
        UntestedVersionWarning: once per process, when the installed accelerate is outside
        :data:`TESTED_VERSIONS`.
    """
    _check_version()
    options = dict(writer_options, compression=compression)
    pyckpt.Writer(os.devnull, **options).close()  # bad options fail here, not mid-save
    with _lock:
        if accelerator in _installs:
            raise ValueError("this accelerator is already installed; uninstall() it first")
        inst = Installation(accelerator, options, trusted, non_fsdp)
        if not _installs:
            _patch()
        _installs[accelerator] = inst
        for name in ("save_state", "load_state"):
            inst._wrapped[name] = vars(accelerator).get(name)
            setattr(accelerator, name, _scoped(inst, getattr(accelerator, name)))
    return inst


def _scoped(inst: Installation, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        token = _current.set(inst)
        try:
            return method(*args, **kwargs)
        finally:
            _current.reset(token)

    return call


# ---- patching -----------------------------------------------------------------------------

# name -> accelerate's function (looked up once, when the module is imported).
_ORIGINALS: dict[str, Callable[..., Any]] = {
    name: getattr(_fsdp_utils, name)
    for name in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
}
_ORIGINALS.update(save_accelerator_state=_checkpointing.save_accelerator_state,
                  load_accelerator_state=_checkpointing.load_accelerator_state)
_patched: list[tuple[ModuleType, str]] = []


def _patch() -> None:
    import sys

    for module in list(sys.modules.values()):
        if not isinstance(module, ModuleType):
            continue
        names = vars(module)  # never getattr: lazy modules (transformers) would import on it
        for name, original in _ORIGINALS.items():
            if names.get(name) is original:
                setattr(module, name, _DISPATCHERS[name])
                _patched.append((module, name))


def _unpatch() -> None:
    while _patched:
        module, name = _patched.pop()
        if vars(module).get(name) is _DISPATCHERS[name]:
            setattr(module, name, _ORIGINALS[name])


def _installed(accelerator: Any) -> Installation | None:
    try:
        return _installs.get(accelerator)
    except TypeError:  # unhashable: not an Accelerator
        return None


def _sharded_dcp(fsdp_plugin: Any, use_dcp: bool) -> bool:
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    return bool(use_dcp) and fsdp_plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT


def _fsdp_context(fsdp_plugin: Any, model: Any) -> Any:
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    if fsdp_plugin.fsdp_version == 1:
        return FSDP.state_dict_type(model, fsdp_plugin.state_dict_type,
                                    fsdp_plugin.state_dict_config,
                                    fsdp_plugin.optim_state_dict_config)
    return nullcontext()


def _folder(parent: str | os.PathLike[str], name: str) -> Path:
    """accelerate's rule: ``parent`` itself when it is already named ``name``."""
    return Path(parent) if Path(parent).name == name else Path(parent) / name


def _is_pyckpt(path: Path) -> bool:
    return (path / _METADATA).is_file()


def _accelerates(path: Path) -> bool:
    """Whether the folder ``path`` is accelerate's to load: it holds no pyckpt checkpoint and is
    not an incomplete pyckpt save (DCP's ``.metadata``, or no folder at all). An incomplete
    pyckpt save is pyckpt's, refused with its typed error."""
    return not _is_pyckpt(path) and ((path / ".metadata").is_file() or not path.is_dir()
                                     or not any(path.iterdir()))


# ---- FSDP (SHARDED_STATE_DICT) --------------------------------------------------------------

def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: Any,
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> Any:
    inst = _installed(accelerator)
    if inst is None or not _sharded_dcp(fsdp_plugin, use_dcp):
        return _ORIGINALS["save_fsdp_model"](fsdp_plugin, accelerator, model, output_dir,
                                             model_index, adapter_only, use_dcp)
    with _fsdp_context(fsdp_plugin, model):
        state = _fsdp_utils._get_model_state_dict(
            model, adapter_only=adapter_only,
            sd_options=_fsdp_utils._prepare_sd_options(fsdp_plugin))
        inst.save({"model": _main_process_buffers(state, set())},
                  os.path.join(output_dir, f"{FSDP_MODEL_NAME}_{model_index}"))
    return None


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: Any,
                    model_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> Any:
    inst = _installed(accelerator)
    path = _folder(input_dir, f"{FSDP_MODEL_NAME}_{model_index}")
    if inst is None or not _sharded_dcp(fsdp_plugin, use_dcp) or _accelerates(path):
        return _ORIGINALS["load_fsdp_model"](fsdp_plugin, accelerator, model, input_dir,
                                             model_index, adapter_only, use_dcp)
    accelerator.wait_for_everyone()
    sd_options = _fsdp_utils._prepare_sd_options(fsdp_plugin)
    with _fsdp_context(fsdp_plugin, model):
        state = {"model": _fsdp_utils._get_model_state_dict(
            model, adapter_only=adapter_only, sd_options=sd_options)}
        inst.load(state, path)
        result = _fsdp_utils._set_model_state_dict(
            model, state["model"], adapter_only=adapter_only, sd_options=sd_options)
    accelerator.wait_for_everyone()
    return result


def _fsdp_optim_state(fsdp_plugin: Any, model: Any, optimizer: Any,
                      load: bool = False) -> Any:
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    if fsdp_plugin.fsdp_version == 2:  # an optimizer that has not stepped is left as it was
        return _stateful.optimizer_state(model, optimizer, fresh_moments=load,
                                         options=_fsdp_utils._prepare_sd_options(fsdp_plugin))
    return FSDP.optim_state_dict(model, optimizer)


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any,
                        output_dir: Any, optimizer_index: int = 0, use_dcp: bool = True) -> Any:
    inst = _installed(accelerator)
    if inst is None or not _sharded_dcp(fsdp_plugin, use_dcp):
        return _ORIGINALS["save_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model,
                                                 output_dir, optimizer_index, use_dcp)
    with _fsdp_context(fsdp_plugin, model):
        state = _fsdp_optim_state(fsdp_plugin, model, optimizer)
        inst.save({"optimizer": state},
                  os.path.join(output_dir, f"{OPTIMIZER_NAME}_{optimizer_index}"))
    return None


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any,
                        input_dir: Any, optimizer_index: int = 0, adapter_only: bool = False,
                        use_dcp: bool = True) -> Any:
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP

    inst = _installed(accelerator)
    path = _folder(input_dir, f"{OPTIMIZER_NAME}_{optimizer_index}")
    if inst is None or not _sharded_dcp(fsdp_plugin, use_dcp) or _accelerates(path):
        return _ORIGINALS["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model,
                                                 input_dir, optimizer_index, adapter_only,
                                                 use_dcp)
    accelerator.wait_for_everyone()
    with _fsdp_context(fsdp_plugin, model):
        # The optimizer's state as the save made it: created here for a fresh optimizer, so the
        # load asks for every moment.
        state = {"optimizer": _fsdp_optim_state(fsdp_plugin, model, optimizer, load=True)}
        inst.load(state, path)
        if fsdp_plugin.fsdp_version == 1:
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                model=model, optim=optimizer, optim_state_dict=state["optimizer"]))
        else:
            _stateful.set_optimizer_state(model, optimizer, state["optimizer"],
                                          options=_fsdp_utils._prepare_sd_options(fsdp_plugin))
    accelerator.wait_for_everyone()
    return None


# ---- without FSDP: models and optimizers as one checkpoint ---------------------------------

def _plain(inst: Installation | None, *lists: list[Any]) -> Installation | None:
    """The installation when this save_state / load_state should go through pyckpt."""
    if inst is None or not inst.non_fsdp or not any(lists):
        return None
    acc = inst.accelerator
    if acc is None or acc.distributed_type in (DistributedType.XLA, DistributedType.FSDP,
                                               DistributedType.DEEPSPEED,
                                               DistributedType.MEGATRON_LM):
        return None
    return inst


def _key(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


def _owner(optimizer: Any, models: list[Any]) -> Any:
    """The model (of the accelerator's) that holds all of ``optimizer``'s parameters."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in models if params <= {id(p) for p in m.parameters()}]
    if len(owners) != 1:
        raise ValueError(
            f"{len(owners)} of the accelerator's {len(models)} prepared models hold all the "
            "parameters of an optimizer; pyckpt keys optimizer state by parameter name and needs "
            "exactly one (or install(..., non_fsdp=False))")
    return owners[0]


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps one
    assert isinstance(inner, torch.optim.Optimizer)
    return inner


def _main_process_buffers(state: dict[str, Any], params: set[int]) -> dict[str, Any]:
    """``state`` (a model's, held by every rank) whose plain tensors other than ``params`` (data
    pointers) only the main process saves: the buffers (BatchNorm's running statistics, ...),
    which DDP and FSDP leave to each rank between broadcasts, so the ranks' copies differ (and
    pyckpt's replica check would refuse the save); accelerate saves the main process's. No
    collective: a rank's save_state hooks may leave it other models than the main process's."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        return state
    return {name: value for name, value in state.items()
            if type(value) not in (torch.Tensor, torch.nn.Parameter)
            or value.data_ptr() in params}


def save_accelerator_state(output_dir: Any, model_states: list[Any], optimizers: list[Any],
                           *args: Any, **kwargs: Any) -> Any:
    inst = _plain(_current.get(), model_states, optimizers)
    if inst is None:
        return _ORIGINALS["save_accelerator_state"](output_dir, model_states, optimizers,
                                                    *args, **kwargs)
    models = inst.accelerator._models
    params = {p.data_ptr() for m in models for p in m.parameters()}
    state: dict[str, Any] = {_key("model", i): _main_process_buffers(s, params)
                             for i, s in enumerate(model_states)}
    for i, opt in enumerate(optimizers):
        inner = _torch_optimizer(opt)
        state[_key("optimizer", i)] = _stateful.optimizer_state(_owner(inner, models), inner)
    inst.save(state, os.path.join(output_dir, STATE_DIR))
    return _ORIGINALS["save_accelerator_state"](output_dir, [], [], *args, **kwargs)


def load_accelerator_state(input_dir: Any, models: list[Any], optimizers: list[Any],
                           *args: Any, **kwargs: Any) -> Any:
    inst = _plain(_current.get(), models, optimizers)
    path = Path(input_dir) / STATE_DIR
    if inst is None or not _is_pyckpt(path):
        return _ORIGINALS["load_accelerator_state"](input_dir, models, optimizers, *args, **kwargs)
    owners = inst.accelerator._models
    state: dict[str, Any] = {_key("model", i): m.state_dict() for i, m in enumerate(models)}
    pairs = []
    for i, opt in enumerate(optimizers):
        inner = _torch_optimizer(opt)
        owner = _owner(inner, owners)
        pairs.append((i, owner, inner))
        # a fresh optimizer's moments: the load asks for those the checkpoint holds
        state[_key("optimizer", i)] = _stateful.optimizer_state(owner, inner, fresh_moments=True)
    inst.load(state, path)
    for i, model in enumerate(models):
        model.load_state_dict(state[_key("model", i)])
    for i, owner, inner in pairs:
        _stateful.set_optimizer_state(owner, inner, state[_key("optimizer", i)])
    return _ORIGINALS["load_accelerator_state"](input_dir, [], [], *args, **kwargs)


_DISPATCHERS: dict[str, Callable[..., Any]] = {
    "save_fsdp_model": save_fsdp_model,
    "load_fsdp_model": load_fsdp_model,
    "save_fsdp_optimizer": save_fsdp_optimizer,
    "load_fsdp_optimizer": load_fsdp_optimizer,
    "save_accelerator_state": save_accelerator_state,
    "load_accelerator_state": load_accelerator_state,
}
