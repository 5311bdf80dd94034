"""Lightning (``lightning.pytorch``) checkpoints through pyckpt.

Lightning's sharded strategies (``FSDPStrategy(state_dict_type="sharded")`` and
``ModelParallelStrategy``) skip ``CheckpointIO`` and call ``dcp.save(checkpoint_id=path)``
themselves, so they can only write DCP's ``FileSystemWriter`` format. This module gives:

* :class:`PyckptFSDPStrategy` / :class:`PyckptModelParallelStrategy`: the same strategies whose
  sharded checkpoints are written with :class:`pyckpt.Writer` and :class:`pyckpt.SavePlanner`
  and read with :class:`pyckpt.Reader` and :class:`pyckpt.LoadPlanner` (every rank writes its
  shards, the save is collective);
* :class:`PyckptCheckpointIO`: a ``CheckpointIO`` for the strategies that use one (DDP, single
  device): rank 0 writes the whole checkpoint dict as a pyckpt checkpoint, every rank reads it.

Checkpoint layout (one pyckpt checkpoint directory, ``pyckpt.json`` committed last, so a
directory loads as the previous or the new checkpoint, never a mixture):

* tensors at their dotted path in Lightning's checkpoint dict: ``state_dict.<param>``,
  ``optimizer_states.0.state.0.exp_avg`` (CheckpointIO); ``model.<param>`` /
  ``state_dict.<param>`` and ``optimizer_0.state.<param>.exp_avg`` (the sharded strategies, the
  keys Lightning's own sharded checkpoints use), so ``pyckpt.load({"state_dict":
  model.state_dict()}, path)`` loads the weights without Lightning;
* everything else (epoch, global_step, loops, callbacks, hparams, ...) as one non-tensor value
  under ``"lightning"``: the ``torch.save`` bytes of that part of the dict (CheckpointIO: its
  tensors replaced by meta tensors, stored at their dotted paths; the sharded strategies: its
  tensors kept in it, as in Lightning's ``meta.pt``), read back with
  ``torch.load(weights_only=...)`` as Lightning reads its ``meta.pt``.

Resuming (``Trainer(...).fit(model, ckpt_path=path)``) reads a pyckpt checkpoint through pyckpt,
and anything else (a Lightning checkpoint file or sharded directory) through Lightning's own
loading, so a run can move onto pyckpt from an existing checkpoint.

Tested with Lightning 2.6 (``pip install pyckpt[lightning]``); other versions warn once
(:class:`LightningVersionWarning`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

try:
    import lightning
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "pyckpt.integrations.lightning needs Lightning (the `lightning` package): "
        "pip install pyckpt[lightning]"
    ) from e

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import pyckpt
from pyckpt.errors import find_error

__all__ = [
    "PyckptCheckpointIO",
    "PyckptFSDPStrategy",
    "PyckptModelParallelStrategy",
    "LightningVersionWarning",
    "TESTED_VERSIONS",
    "is_pyckpt_checkpoint",
]

#: Lightning versions this module was tested with: ``[low, high)``.
TESTED_VERSIONS = ("2.6", "2.7")

# The key of the non-tensor part of Lightning's checkpoint dict.
_META_KEY = "lightning"


class LightningVersionWarning(UserWarning):
    """The installed Lightning is outside the versions :mod:`pyckpt.integrations.lightning`
    was tested with (:data:`TESTED_VERSIONS`)."""


_version_checked = False


def _release(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if not piece.isdigit() else piece
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:  # 2.7.0rc1: stop at the pre-release
            break
    return tuple(parts)


def _check_version() -> None:
    """Warns once per process when Lightning is outside :data:`TESTED_VERSIONS`."""
    global _version_checked
    if _version_checked:
        return
    _version_checked = True
    version = str(getattr(lightning, "__version__", "0"))
    low, high = (_release(v) for v in TESTED_VERSIONS)
    if not low <= _release(version) < high:
        warnings.warn(
            f"pyckpt.integrations.lightning was tested with Lightning >={TESTED_VERSIONS[0]},"
            f"<{TESTED_VERSIONS[1]}; found {version}: its checkpoint hooks may have changed",
            LightningVersionWarning,
            stacklevel=3,
        )


def is_pyckpt_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed pyckpt checkpoint directory (holds ``pyckpt.json``)."""
    return os.path.isfile(os.path.join(os.fspath(path), "pyckpt.json"))


# ---------------------------------------------------------------------------------------------
# Splitting Lightning's checkpoint dict into tensors and the rest.


def _fqn(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _split(obj: Any, path: tuple[Any, ...], tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a meta tensor of its shape and dtype; the tensors
    go to ``tensors`` keyed by their dotted path. Dicts, lists and tuples are walked."""
    if isinstance(obj, torch.Tensor):
        name = _fqn(path)
        if name in tensors:
            raise ValueError(f"two tensors of the checkpoint have the same dotted path {name!r}")
        tensors[name] = obj
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        return _split_dict(obj, path, tensors)
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_split(v, (*path, i), tensors) for i, v in enumerate(obj))
    return obj


def _split_dict(obj: dict[Any, Any], path: tuple[Any, ...],
                tensors: dict[str, torch.Tensor]) -> dict[Any, Any]:
    out = obj.copy()  # keeps the dict's type (OrderedDict, AttributeDict)
    for k, v in obj.items():
        out[k] = _split(v, (*path, k), tensors)
    return out


def _join(obj: Any, path: tuple[Any, ...], tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_split`: meta tensors replaced by ``tensors[dotted path]``."""
    if isinstance(obj, torch.Tensor) and obj.is_meta:
        return tensors[_fqn(path)]
    if isinstance(obj, dict):
        out = obj.copy()
        for k, v in obj.items():
            out[k] = _join(v, (*path, k), tensors)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_join(v, (*path, i), tensors) for i, v in enumerate(obj))
    return obj


def _meta_tensors(obj: Any, path: tuple[Any, ...], out: dict[str, torch.Tensor]) -> None:
    """Empty CPU tensors to load into, one per meta tensor of ``obj``, keyed by dotted path."""
    if isinstance(obj, torch.Tensor) and obj.is_meta:
        out[_fqn(path)] = torch.empty(obj.shape, dtype=obj.dtype)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _meta_tensors(v, (*path, k), out)
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _meta_tensors(v, (*path, i), out)


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickled(blob: Any, weights_only: bool | None, map_location: Any = None) -> Any:
    if not isinstance(blob, (bytes, bytearray)):
        raise pyckpt.CheckpointFormatError(
            f"the {_META_KEY!r} entry of the checkpoint is not the bytes pyckpt's Lightning "
            f"integration writes (found {type(blob).__name__})")
    return torch.load(io.BytesIO(blob), map_location=map_location, weights_only=weights_only)


# ---------------------------------------------------------------------------------------------
# Single-process save and load (CheckpointIO: rank 0 saves, every rank loads on its own).


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    """The failing rank's own exception (``OSError``, :class:`pyckpt.PyckptError`, ...) instead
    of DCP's ``CheckpointException`` wrapper, which stays attached as ``__cause__``."""
    try:
        yield
    except CheckpointException as wrapped:
        original = find_error(wrapped)
        if original is None:
            raise
        raise original from wrapped


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    with warnings.catch_warnings():  # one process by design, not by accident
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


def _save_local(state: dict[str, Any], path: str, writer_options: Mapping[str, Any]) -> None:
    with pyckpt.Writer(path, **writer_options) as writer, _one_process(), _typed_errors():
        dcp.save(state, storage_writer=writer, planner=pyckpt.SavePlanner(), no_dist=True)


def _load_local(state: dict[str, Any], path: str, trusted: bool) -> None:
    reader = pyckpt.Reader(path, cooperative=False)
    with _one_process(), _typed_errors():
        dcp.load(state, storage_reader=reader, planner=pyckpt.LoadPlanner(trusted=trusted),
                 no_dist=True)


def _writer_options(compression: str | None,
                    writer_options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(writer_options or {})
    if compression is not None:
        options["compression"] = compression
    pyckpt.Writer("/", **options).close()  # bad options fail here, not at the first save
    return options


@contextlib.contextmanager
def _replacing_file(path: str) -> Iterator[None]:
    """A checkpoint file at ``path`` (Lightning's own, e.g. ``last.ckpt`` of a run that moved onto
    pyckpt) is replaced, as Lightning's ``TorchCheckpointIO`` replaces it: moved aside while the
    checkpoint directory is written, removed once it is committed, put back if the save fails."""
    if not os.path.isfile(path):
        yield
        return
    aside = f"{path}.pyckpt-replaced"
    os.replace(path, aside)
    try:
        yield
    except BaseException:
        if not os.path.lexists(path):
            os.replace(aside, path)
        raise
    os.unlink(aside)


class PyckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` writing each checkpoint as a pyckpt checkpoint directory.

    For the strategies that save through a ``CheckpointIO`` (single device, DDP; not FSDP's
    ``state_dict_type="full"``, whose load expects a file): Lightning calls :meth:`save_checkpoint` on rank 0 only, so the
    save runs in that process alone; :meth:`load_checkpoint` runs on every rank.

        trainer = Trainer(plugins=[PyckptCheckpointIO(compression="zstd")], ...)

    Args:
        compression: ``None`` (raw) or ``"zstd"`` (see :class:`pyckpt.Writer`).
        writer_options: more :class:`pyckpt.Writer` arguments (``threads``, ``fsync``,
            ``overwrite``, ``level``, ...).

    Raises:
        ValueError: invalid writer options.
    """

    def __init__(self, compression: str | None = None, *,
                 writer_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        _check_version()
        self.writer_options = _writer_options(compression, writer_options)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Writes ``checkpoint`` (Lightning's dict) to the directory ``path``.

        A checkpoint file at ``path`` (Lightning's) is replaced by the directory, as Lightning
        replaces it; it is left in place if the save fails.

        Raises:
            TypeError: ``storage_options`` was given (pass Writer options to the constructor).
            OSError, pyckpt.PyckptError: the writer's own error (e.g. ``FileExistsError`` with
                ``overwrite=False``, ``NotADirectoryError`` when ``path`` is under a file).
        """
        if storage_options is not None:
            raise TypeError("PyckptCheckpointIO.save_checkpoint(..., storage_options=...) is not "
                            "supported: pass Writer options to PyckptCheckpointIO(...)")
        tensors: dict[str, torch.Tensor] = {}
        rest = _split(checkpoint, (), tensors)
        if _META_KEY in tensors:
            raise ValueError(f"the checkpoint holds a tensor named {_META_KEY!r}")
        path = os.fspath(path)
        if not self.writer_options.get("overwrite", True) and os.path.isfile(path):
            raise FileExistsError(errno.EEXIST, "a checkpoint file is there (overwrite=False)",
                                  path)
        with _replacing_file(path):
            _save_local({**tensors, _META_KEY: _pickled(rest)}, path, self.writer_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Reads the checkpoint dict at ``path`` (a pyckpt checkpoint; anything else is read by
        Lightning's ``TorchCheckpointIO``). Tensors are read onto the CPU, then moved by
        ``map_location`` if one is given. ``weights_only`` is as for ``torch.load`` (Lightning's
        meaning), for the non-tensor part and the checkpoint's non-tensor values.

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            pyckpt.CheckpointFormatError: a damaged checkpoint.
        """
        path = os.fspath(path)
        if not is_pyckpt_checkpoint(path) and os.path.isfile(path):
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
        trusted = weights_only is False
        head: dict[str, Any] = {_META_KEY: b""}
        _load_local(head, path, trusted)
        rest = _unpickled(head[_META_KEY], weights_only)
        tensors: dict[str, torch.Tensor] = {}
        _meta_tensors(rest, (), tensors)
        if tensors:
            _load_local(tensors, path, trusted)
            if map_location is not None:
                tensors = {k: _mapped(v, map_location) for k, v in tensors.items()}
        checkpoint: dict[str, Any] = _join(rest, (), tensors)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the checkpoint directory (or file) ``path``."""
        path = os.fspath(path)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)


def _mapped(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    if isinstance(map_location, (str, torch.device)):
        return tensor.to(map_location)
    if isinstance(map_location, Mapping):
        target = map_location.get(str(tensor.device))
        return tensor if target is None else tensor.to(target)
    if callable(map_location):  # torch.load's (storage, location) -> storage convention
        return tensor  # a host tensor stays where torch.load(map_location=f) would leave it
    return tensor


# ---------------------------------------------------------------------------------------------
# Sharded strategies (collective saves and loads on every rank).


def _main_process_plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The model's state dict with its plain tensors (not sharded ones) saved by rank 0 only:
    FSDP2 shards the parameters and leaves the buffers (BatchNorm's running statistics) to each
    rank, which updates them with its own batches; pyckpt's replica check would refuse the save,
    Lightning's saves one copy."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        return state_dict
    return {name: value for name, value in state_dict.items()
            if type(value) not in (torch.Tensor, torch.nn.Parameter)}  # DTensor, ShardedTensor


def _save_sharded(strategy: Any, checkpoint: dict[str, Any], filepath: Any, model_key: str,
                  writer_options: Mapping[str, Any]) -> None:
    path = os.fspath(strategy.broadcast(os.fspath(filepath)))
    if os.path.isfile(path):  # Lightning's sharded save replaces a file the same way
        if strategy.global_rank == 0:
            os.unlink(path)
        strategy.barrier("pyckpt_lightning_unlink")
    state: dict[str, Any] = {model_key: _main_process_plain(checkpoint.pop("state_dict"))}
    for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{idx}"] = optim_state
    # The rest whole, tensors included (callbacks' scores, a user's on_save_checkpoint
    # tensors), as Lightning's own meta.pt holds it: they may differ between ranks, so they
    # are not stored as (replicated) entries.
    state[_META_KEY] = _pickled(checkpoint)
    pyckpt.save(state, path, **writer_options)


def _load_sharded(strategy: Any, checkpoint_path: Any, model_key: str,
                  weights_only: bool | None) -> dict[str, Any]:
    path = os.fspath(strategy.broadcast(os.fspath(checkpoint_path)))
    assert strategy.model is not None and strategy.lightning_module is not None
    trusted = weights_only is False
    state: dict[str, Any] = {model_key: strategy.model, _META_KEY: b""}
    if strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING:
        # Models and optimizers go through torch.distributed.checkpoint.state_dict: a fresh
        # optimizer's state is created first, so every moment is loaded.
        state.update({f"optimizer_{i}": o for i, o in enumerate(strategy.optimizers)})
    pyckpt.load(state, path, trusted=trusted)
    metadata: dict[str, Any] = _unpickled(state[_META_KEY], weights_only)
    return metadata


class PyckptFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` whose sharded checkpoints go through pyckpt.

    ``state_dict_type`` defaults to ``"sharded"`` here: every rank writes its own shards of
    the model and optimizer state with :class:`pyckpt.Writer` (a collective save, planned by
    :class:`pyckpt.SavePlanner`). With ``state_dict_type="full"`` checkpoints are Lightning's
    (a single ``torch.save`` file written by rank 0 through ``checkpoint_io``).

        trainer = Trainer(strategy=PyckptFSDPStrategy(compression="zstd"), ...)

    Args:
        compression: ``None`` (raw) or ``"zstd"``.
        writer_options: more :class:`pyckpt.Writer` arguments.
        state_dict_type: ``"sharded"`` (pyckpt) or ``"full"`` (Lightning's).
        *args, **kwargs: as for ``FSDPStrategy``.
    """

    def __init__(self, *args: Any, compression: str | None = None,
                 writer_options: Mapping[str, Any] | None = None,
                 state_dict_type: str = "sharded", **kwargs: Any) -> None:
        _check_version()
        kwargs["state_dict_type"] = state_dict_type
        super().__init__(*args, **kwargs)
        self.writer_options = _writer_options(compression, writer_options)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Saves the checkpoint (collective: every rank calls it, as Lightning does).

        Raises:
            TypeError: ``storage_options`` was given.
            OSError, pyckpt.PyckptError: the lowest failing rank's own error.
        """
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("PyckptFSDPStrategy.save_checkpoint(..., storage_options=...) is not "
                            "supported: pass Writer options to the strategy")
        _save_sharded(self, checkpoint, filepath, "model", self.writer_options)

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Loads a pyckpt checkpoint into the model and optimizers and returns the rest of the
        checkpoint dict; any other checkpoint is loaded by ``FSDPStrategy``."""
        if not is_pyckpt_checkpoint(self.broadcast(os.fspath(checkpoint_path))):
            return super().load_checkpoint(checkpoint_path, weights_only)
        return _load_sharded(self, checkpoint_path, "model", weights_only)


class PyckptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose distributed checkpoints go through pyckpt.

    With ``save_distributed_checkpoint=True`` (the default) every rank writes its shards with
    :class:`pyckpt.Writer`; with False, checkpoints are Lightning's single file.

    Args:
        compression: ``None`` (raw) or ``"zstd"``.
        writer_options: more :class:`pyckpt.Writer` arguments.
        *args, **kwargs: as for ``ModelParallelStrategy``.
    """

    def __init__(self, *args: Any, compression: str | None = None,
                 writer_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        _check_version()
        super().__init__(*args, **kwargs)
        self.writer_options = _writer_options(compression, writer_options)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """As :meth:`PyckptFSDPStrategy.save_checkpoint`."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("PyckptModelParallelStrategy.save_checkpoint(..., storage_options=...)"
                            " is not supported: pass Writer options to the strategy")
        _save_sharded(self, checkpoint, filepath, "state_dict", self.writer_options)

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """As :meth:`PyckptFSDPStrategy.load_checkpoint`."""
        if not is_pyckpt_checkpoint(self.broadcast(os.fspath(checkpoint_path))):
            return super().load_checkpoint(checkpoint_path, weights_only)
        return _load_sharded(self, checkpoint_path, "state_dict", weights_only)
