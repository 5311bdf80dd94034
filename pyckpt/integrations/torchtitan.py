"""torchtitan's checkpoints through pyckpt: a checkpoint manager a job selects in its config.

torchtitan (0.3) builds its checkpoint manager from the job config's ``checkpoint`` field (a
``BaseCheckpointManager.Config``; the config's ``build()`` constructs the class that declares
it). :class:`PyckptCheckpointManager` subclasses torchtitan's DCP ``CheckpointManager`` and
declares its own ``Config``, so a job selects it with::

    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    config.checkpoint = PyckptCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, compression="zstd")

Everything torchtitan's manager does stays as it is (intervals, ``async_mode``,
``keep_latest_k``, ``load_step``, ``exclude_from_loading``, the model-only last save and its
``export_dtype``, ``initial_load_path``); only the two methods that touch storage change:

* ``dcp_save`` writes with :class:`pyckpt.Writer` and :class:`pyckpt.SavePlanner` (compressed
  with ``compression="zstd"``), in the three ``async_mode``\\ s: ``"disabled"``
  (:func:`pyckpt.save`: the plans cached while the state's structure holds),
  ``"async"`` (:func:`pyckpt.async_save`: staged in the call, written on pyckpt's save
  thread, the plans cached as well) and
  ``"async_with_pinned_mem"`` (DCP's process-based async save with torchtitan's
  ``DefaultStager``: the writer is pickled into DCP's checkpoint process). A pyckpt error on
  any rank reaches the caller as itself (``FileExistsError``, ``OSError``,
  :class:`pyckpt.PyckptError`...), not inside DCP's ``CheckpointException``; for the async
  modes, from the save's future (torchtitan waits on it before the next save).
* The HF export of the last save (``last_save_in_hf``) saves the adapter's HF state dict as a
  pyckpt checkpoint in a hidden folder of the step, then :func:`pyckpt.consolidate` writes the
  safetensors files and ``model.safetensors.index.json`` into the step folder, each rank
  writing its share (files as the adapter's ``fqn_to_index_mapping`` says). With
  ``shared_filesystem=False`` no shared file system is needed: each node holds only its own
  files and its share of the export (see docs/integrations/torchtitan.md).
* ``dcp_load`` reads a pyckpt checkpoint with :class:`pyckpt.Reader` and
  :class:`pyckpt.LoadPlanner`, refusing a load that would silently drop stored entries
  (:class:`pyckpt.PartialLoadError`); a checkpoint written by torchtitan's own writer
  (``.metadata``) or an HF one is read by torchtitan's own code, so a job can move to pyckpt
  with ``initial_load_path`` pointing at its old checkpoints.

``s3://`` folders work as in torchtitan (its ``filesystem`` helpers, over fsspec, list and
purge; pyckpt's own object-store client writes and reads, from the ``AWS_*`` environment).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

try:
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.tools import filesystem
    from torchtitan.tools.utils import GarbageCollection
except ImportError as e:  # torchtitan missing (or broken): name the extra
    raise ImportError(
        "pyckpt.integrations.torchtitan needs torchtitan: pip install pyckpt[torchtitan]"
    ) from e

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.stateful import Stateful

import pyckpt
from pyckpt._collective import coordination_arg
from pyckpt._consolidate import consolidate
from pyckpt._format import CODEC_NONE, CODECS
from pyckpt._loadplan import LoadPlanner
from pyckpt.errors import find_error
from pyckpt.planner import SavePlanner
from pyckpt.storage import Reader, Writer

__all__ = ["PyckptCheckpointManager", "UntestedVersionWarning", "TESTED_VERSIONS"]

logger = logging.getLogger(__name__)

#: The torchtitan releases this module was tested with: ``>= low, < high``.
TESTED_VERSIONS = ("0.3.0", "0.4")

# The hidden folder of a step that holds the HF export's source (removed once exported).
_HF_SOURCE = ".pyckpt-hf-source"
_PYCKPT_METADATA = "pyckpt.json"


class UntestedVersionWarning(UserWarning):
    """The installed torchtitan is outside the range this integration was tested with."""


_version_warned = False


def _installed_version() -> str:
    return importlib.metadata.version("torchtitan")


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version`` ("0.3.0.dev20250101+cpu" -> (0, 3, 0))."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def _check_version() -> None:
    """Warns once per process when torchtitan's version is outside :data:`TESTED_VERSIONS`."""
    global _version_warned
    if _version_warned:
        return
    try:
        version = _installed_version()
    except importlib.metadata.PackageNotFoundError:  # a source checkout: nothing to compare
        return
    low, high = (_release(v) for v in TESTED_VERSIONS)
    if not low <= _release(version) < high:
        _version_warned = True
        warnings.warn(
            f"pyckpt.integrations.torchtitan was tested with torchtitan>={TESTED_VERSIONS[0]},"
            f"<{TESTED_VERSIONS[1]}; torchtitan {version} is installed: its checkpoint "
            "manager may have changed (check dcp_save/dcp_load before relying on it)",
            UntestedVersionWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    """Re-raises the failing rank's own error instead of DCP's ``CheckpointException`` (a
    ``BaseException`` whose type says nothing); the wrapper stays attached as the cause."""
    try:
        yield
    except CheckpointException as wrapped:
        original = find_error(wrapped)
        if original is None or original is wrapped:
            raise
        raise original from wrapped


def _state_dicts(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Stateful values as their state dicts, as DCP's save makes them (torchtitan's optimizers
    container is an ``Optimizer``: :func:`pyckpt.save` would key its state by parameter
    name)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _typed_future(fut: Future[Any]) -> Future[Any]:
    """A future that completes with ``fut``: its error unwrapped as in :func:`_typed_errors`."""
    typed: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        try:
            with _typed_errors():
                result = f.result()
        except BaseException as e:
            typed.set_exception(e)
        else:
            typed.set_result(result)

    fut.add_done_callback(done)
    return typed


def _is_pyckpt(checkpoint_id: str) -> bool:
    return filesystem.isfile(filesystem.join(checkpoint_id, _PYCKPT_METADATA))


def _is_torchtitans(checkpoint_id: str) -> bool:
    """Whether ``checkpoint_id`` holds a checkpoint torchtitan's own code reads: DCP's
    (``.metadata``) or an HF export (its index). Anything else, an incomplete pyckpt save
    included, is pyckpt's to read (and to refuse with its typed error)."""
    return any(filesystem.isfile(filesystem.join(checkpoint_id, name))
               for name in (".metadata", "model.safetensors.index.json"))


def _is_step_checkpoint(path: str) -> bool:
    """Whether the step folder ``path`` holds a complete checkpoint of any kind torchtitan loads:
    pyckpt's, DCP's own (``.metadata``) or an HF export (its index)."""
    return any(
        filesystem.isfile(filesystem.join(path, name))
        for name in (_PYCKPT_METADATA, ".metadata", "model.safetensors.index.json")
    )


def _forget_listings(folder: str) -> None:
    """Drops fsspec's cached listings of a remote ``folder``: pyckpt writes objects with its own
    client, so fsspec never learns of them, and a listing cached earlier (the purge's, a load's)
    would hide the steps saved since (the purge would keep too many, ranks could resume from
    different steps)."""
    if filesystem.is_remote(folder):
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(folder)
        fs.invalidate_cache(path)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))


class PyckptCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager, saving and loading through pyckpt.

    Built by torchtitan from :class:`PyckptCheckpointManager.Config` (the job config's
    ``checkpoint`` field) with the same arguments as torchtitan's ``CheckpointManager``. Warns
    once (:class:`UntestedVersionWarning`) when torchtitan's version is outside
    :data:`TESTED_VERSIONS`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint settings, and pyckpt's."""

        compression: Literal["none", "zstd"] = "none"
        """Stored form of tensors: "none" (raw) or "zstd" (per-chunk zstd, byte-grouped)."""

        zstd_level: int | None = None
        """zstd level (default PYCKPT_ZSTD_LEVEL or 1)."""

        threads: int | None = None
        """Native worker threads per rank (default PYCKPT_NUM_THREADS or min(8, cpus))."""

        overwrite: bool = True
        """False: a save into a step folder that already holds a checkpoint raises
        FileExistsError instead of replacing it."""

        shared_filesystem: bool = True
        """False: the folder is node-local (each node holds its own ranks' files; no shared
        file system); saves, loads, the HF export and the purge then run per node."""

        trusted_load: bool = False
        """True: non-tensor values are unpickled with full pickle, not weights-only."""

        cooperative_load: bool | None = None
        """pyckpt.Reader's cooperative: stored bytes several ranks load read once and shared
        over the job's group (None: pyckpt decides per load; see docs/REPLICATED.md)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            compression = (self.compression or CODEC_NONE).lower()
            if compression not in CODECS:
                raise ValueError(f"Invalid compression: {self.compression!r} "
                                 f"({' or '.join(CODECS)})")
            self.compression = compression  # type: ignore[assignment]
            if not self.shared_filesystem and filesystem.is_remote(self.folder):
                raise ValueError("shared_filesystem=False needs a local checkpoint.folder")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        _check_version()
        super().__init__(config, **kwargs)
        self.compression = None if config.compression == CODEC_NONE else config.compression
        self.zstd_level = config.zstd_level
        self.threads = config.threads
        self.overwrite = config.overwrite
        self.shared_filesystem = config.shared_filesystem
        self.trusted_load = config.trusted_load
        self.cooperative_load = config.cooperative_load

    # -- storage --------------------------------------------------------------------------

    def _writer_options(self) -> dict[str, Any]:
        return {"compression": self.compression, "level": self.zstd_level,
                "threads": self.threads, "overwrite": self.overwrite,
                "shared_filesystem": self.shared_filesystem}

    def _writer(self, path: str) -> Writer:
        return Writer(path, **self._writer_options())

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        """Saves ``state_dict`` to ``checkpoint_id`` through pyckpt (torchtitan's signature).

        Returns None (``"disabled"``, and the HF export), a future (``"async"``) or DCP's
        ``AsyncSaveResponse`` (``"async_with_pinned_mem"``); the futures fail with the
        failing rank's own error.
        """
        ret: Future[Any] | AsyncSaveResponse | None = None
        if to_hf:
            self._save_hf(state_dict, checkpoint_id)
        elif async_mode == AsyncMode.ASYNC:
            # pyckpt.async_save: staged here, written on pyckpt's save thread with the plans
            # cached as for "disabled" (dcp.async_save plans in full every save), its
            # exchanges on a gloo group of its own; the future fails with the typed error.
            ret = pyckpt.async_save(_state_dicts(state_dict), checkpoint_id,
                                    process_group=self.pg, **self._writer_options())
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            with _typed_errors():
                response = dcp.async_save(
                    state_dict,
                    storage_writer=self._writer(checkpoint_id),
                    planner=SavePlanner(),
                    process_group=self.pg,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=self.stager,
                )
            if isinstance(response, AsyncSaveResponse):
                ret = AsyncSaveResponse(
                    staging_completion=response.staging_completion,
                    upload_completion=_typed_future(response.upload_completion),
                )
            else:
                ret = _typed_future(response)
        else:
            # pyckpt.save: the plans are cached while the state's structure holds (a later
            # save gathers a few hundred bytes per rank), coordination on a gloo group with
            # the training's ranks (no GPU memory), errors typed.
            pyckpt.save(_state_dicts(state_dict), checkpoint_id, **self._writer_options())
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _save_hf(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """The HF export: the adapter's HF state dict saved with pyckpt into a hidden folder of
        the step, consolidated into safetensors files by every rank, then the source removed."""
        assert self.sd_adapter is not None, "sd_adapter is required for last_save_in_hf"
        hf_state_dict = self.sd_adapter.to_hf(state_dict)
        mapping = self.sd_adapter.fqn_to_index_mapping
        source = filesystem.join(checkpoint_id, _HF_SOURCE)
        with _typed_errors():
            dcp.save(hf_state_dict, storage_writer=self._writer(source), planner=SavePlanner(),
                     process_group=coordination_arg())
        consolidate(
            source,
            checkpoint_id,
            fqn_to_file=dict(mapping) if mapping else None,
            select=None,
            threads=self.threads,
            shared_filesystem=self.shared_filesystem,
        )
        # Every rank's share is in (and the index published) once all ranks are past this point.
        if dist.is_initialized():
            dist.barrier()
        remover = _local_rank() == 0 if not self.shared_filesystem else (
            not dist.is_initialized() or dist.get_rank() == 0)
        if remover:
            shutil.rmtree(source, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Loads ``checkpoint_id`` into ``state_dict`` (torchtitan's signature): a pyckpt
        checkpoint through :class:`pyckpt.Reader`; HF safetensors and DCP's own checkpoints
        through torchtitan's code.

        Raises:
            pyckpt.PartialLoadError: the load would leave stored entries behind under a key
                the state dict holds (e.g. an optimizer whose state is empty); nothing loaded.
            FileNotFoundError, pyckpt.ChecksumError, ...: as raised by the reader on the
                lowest failing rank.
        """
        if from_hf or (not _is_pyckpt(checkpoint_id) and _is_torchtitans(checkpoint_id)):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        group = coordination_arg()
        reader = Reader(
            checkpoint_id,
            process_group=group,
            threads=self.threads,
            shared_filesystem=self.shared_filesystem,
            cooperative=self.cooperative_load,
            allow_partial=False,
        )
        with _typed_errors():
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=LoadPlanner(trusted=self.trusted_load),
                process_group=group,
            )
        # torchtitan flattens the model's entries into the top level: load them into it.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    # -- folder scans ---------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        """The highest ``step-N`` under ``folder`` holding a complete checkpoint (pyckpt's, DCP's
        or an HF export), or -1."""
        import re

        folder = folder or self.folder
        _forget_listings(folder)
        if not filesystem.isdir(folder):
            return -1
        steps = []
        for name in filesystem.listdir(folder):
            match = re.search(r"step-(\d+)", name)
            if match and _is_step_checkpoint(filesystem.join(folder, name)):
                steps.append(int(match.group(1)))
        return max(steps) if steps else -1

    def _purge_stale_checkpoints(self) -> None:
        _forget_listings(self.folder)
        super()._purge_stale_checkpoints()

    def _should_purge(self) -> bool:
        if self.shared_filesystem:
            return bool(super()._should_purge())
        # Node-local folders: one rank per node purges its node's copy.
        return self.keep_latest_k > 0 and _local_rank() == 0 and filesystem.isdir(self.folder)
