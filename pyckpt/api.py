"""One-line save and load through DCP with pyckpt's writer, reader and planner.

    pyckpt.save(model.state_dict(), "/ckpt/step-100")           # every rank calls it
    fut = pyckpt.async_save(model.state_dict(), "/ckpt/step-200")  # returns once staged
    pyckpt.load(state_dict, "/ckpt/step-100")                    # fills state_dict in place

All three are collective when a default process group exists (or ``process_group`` is given) and
work in a single process otherwise, like ``dcp.save`` / ``dcp.load`` (without DCP's warning
about running in a single process).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from pyckpt import _background, _gc, _loaddrive, _progress, _savedrive, _stateful
from pyckpt._collective import (
    Group,
    bounded_group,
    coordination_arg,
    group_info,
    own_group,
    peer_errors,
)
from pyckpt._loadplan import LoadPlanner
from pyckpt.errors import PyckptError
from pyckpt.planner import SavePlanner
from pyckpt.storage import Reader, Writer

__all__ = ["save", "async_save", "load"]

logger = logging.getLogger(__name__)


def load_planner(trusted: bool = False) -> LoadPlanner:
    """The load planner pyckpt's own load paths use (:class:`pyckpt.LoadPlanner`): indexed
    planning, and weights-only unpickling of non-tensor values unless ``trusted``."""
    return LoadPlanner(trusted=trusted)


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    """Re-raises the original exception of the lowest failing rank instead of DCP's
    ``CheckpointException`` wrapper (a ``BaseException`` that hides the type): callers can catch
    ``FileNotFoundError``, :class:`pyckpt.ChecksumError`, ``OSError`` (disk full) and so on.
    The wrapper, with every rank's failure, stays attached as ``__cause__``; when the error has
    a cause of its own (e.g. the object-store client's report), that cause is kept and the
    wrapper is its ``__context__``."""
    try:
        yield
    except CheckpointException as wrapped:
        failures = getattr(wrapped, "failures", None) or {}
        if not failures:
            raise
        first = failures[min(failures)]
        original = first[0] if isinstance(first, tuple) else first
        # Ctrl-C during the native work arrives wrapped too: the user pressed it, so it is what
        # they get back (and `except KeyboardInterrupt` works as it would without DCP).
        if not isinstance(original, (Exception, KeyboardInterrupt)):
            raise
        if original.__cause__ is not None:
            raise original  # noqa: B904 - keeps its own cause; ``wrapped`` becomes the context
        raise original from wrapped


# DCP's load logs (on the root logger, with a traceback) that it "falls back to rank local
# metadata" whenever the reader's read_metadata raises, then raises the reader's error anyway:
# for a missing checkpoint the user would see a page of DCP internals before pyckpt's
# FileNotFoundError. Records of these messages are dropped while pyckpt.load runs in this
# thread (or task); DCP's own loads elsewhere keep them.
_DCP_METADATA_NOISE = (
    "Global metadata is not found. Falling back to rank local metadata.",
    "Rank local metadata is not found.",
)
_quiet_metadata: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pyckpt_quiet_metadata", default=False
)


class _DropMetadataNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_quiet_metadata.get() and record.msg in _DCP_METADATA_NOISE)


_noise_filter = _DropMetadataNoise()


@contextlib.contextmanager
def _quiet_missing_metadata() -> Iterator[None]:
    """Drops DCP's "metadata is not found" warnings (see above): the reader's own error, raised
    right after, names the path and says what is missing."""
    root = logging.getLogger()
    if _noise_filter not in root.filters:
        root.addFilter(_noise_filter)
    token = _quiet_metadata.set(True)
    try:
        yield
    finally:
        _quiet_metadata.reset(token)


@contextlib.contextmanager
def _single_process_quiet(no_dist: bool = False) -> Iterator[None]:
    """Silences DCP's warning that it runs in one process: for these helpers that is a mode,
    not an accident (e.g. loading a multi-rank checkpoint offline). ``no_dist``: the caller
    passes ``no_dist=True`` to DCP, so it is single-process even in a distributed job."""
    if not no_dist and dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def _bounded_if_node_local(reader: Reader) -> Any:
    """A node-local load (every read batch one exchange round all ranks take part in): the
    group's timeout lowered to the peer bound for the load (pyckpt._collective.bounded_group)."""
    backend = reader.backend
    if backend.collective_loads:
        return bounded_group(reader.process_group)
    return contextlib.nullcontext()


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    check_replicas: bool | Literal["sample", "full"] = True,
    progress: _progress.ProgressArg = False,
    **writer_options: Any,
) -> Metadata:
    """Saves ``state_dict`` to the checkpoint directory ``path`` with DCP.

    Uses :class:`pyckpt.Writer` and :class:`pyckpt.SavePlanner`, so replicated state (DDP,
    FSDP ``NO_SHARD``, ``Replicate()`` DTensors, HSDP replicas) is written in balanced byte
    ranges by all the ranks that hold it.

    Plans are cached: a save whose state has the structure of this process group's previous
    save (keys, shapes, dtypes, placements; same world size, destination kind and options)
    reuses its plans after one small check that every rank agrees, instead of gathering every
    rank's plan to rank 0 again (:mod:`pyckpt._savedrive`). Any difference on any rank plans
    again, on every rank.

    Args:
        state_dict: The (possibly nested) state dict, as for ``dcp.save``. Top-level values
            may be modules and optimizers themselves (``{"model": model, "optim": optim}``):
            they are saved through ``torch.distributed.checkpoint.state_dict`` (the optimizer
            keyed by parameter name), a ``torch.Generator`` as its state (one per rank: key
            it by rank, as replicated values must agree), and other ``Stateful`` values through
            ``state_dict()``. A module or optimizer deeper in the state is a ``TypeError``.
        path: Checkpoint directory; created if missing.
        process_group: Process group of the save (default: the default group, if any). The
            save's coordination runs on :func:`pyckpt.coordination_group` of it (the group
            itself when it is gloo), so an NCCL group costs no GPU memory.
        check_replicas: Refuse (:class:`pyckpt.ReplicaMismatchError`, before anything is
            written) replicated tensors whose copies differ across ranks. ``True`` /
            ``"sample"``: compare a sample of at most 1 MiB per tensor; ``"full"``: every
            byte; ``False``: save anyway (see :class:`pyckpt.SavePlanner`).
        progress: ``True`` shows the save's progress on stderr (rank 0 only; a bar on a
            terminal, a log line every few seconds otherwise); a callable is called as
            ``progress(bytes_done, bytes_total)`` (this rank's bytes) about every 0.1 s.
        **writer_options: Passed to :class:`pyckpt.Writer` (``compression="zstd"``,
            ``threads``, ``direct_io``, ``fsync``, ``shared_filesystem=False`` for a
            node-local checkpoint, ...).

    Returns:
        The DCP ``Metadata`` of the saved checkpoint.

    Raises:
        ValueError: Invalid writer options.
        OSError, pyckpt.PyckptError, ...: the exception of the lowest failing rank, re-raised
            from DCP's ``CheckpointException`` (attached as ``__cause__``), e.g. ``OSError``
            (ENOSPC, EFBIG) from a data file or :class:`pyckpt.UnsupportedDtypeError`.
    """
    _settle_async()  # one save at a time: one staged copy, one set of writes
    # The save's per-tensor objects (items, plans, results) die with its Writer when _save
    # returns, before any collection walks them (pyckpt._gc).
    with _gc.paused():
        return _save(_stateful.to_save(state_dict), path, process_group, check_replicas, progress,
                     writer_options)


def _save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    process_group: Any,
    check_replicas: bool | Literal["sample", "full"],
    progress: _progress.ProgressArg,
    writer_options: dict[str, Any],
) -> Metadata:
    # The save's exchanges run on a gloo group with the same ranks (host memory, even for NCCL).
    process_group = coordination_arg(process_group)
    with peer_errors(process_group, "pyckpt.save"), Writer(path, **writer_options) as writer, \
            _single_process_quiet(), _typed_errors(), \
            _save_progress(progress, writer, process_group):
        return _savedrive.save(state_dict, writer, SavePlanner(check_replicas=check_replicas),
                               group_info(process_group))


@contextlib.contextmanager
def _save_progress(progress: _progress.ProgressArg, writer: Writer,
                   process_group: Any) -> Iterator[None]:
    """A save's progress: the native bytes written, towards this rank's planned bytes (known
    once the plan is, when ``writer.write_data`` starts)."""
    totals = [0]
    with _progress.job(progress, "save", process_group) as report, \
            _progress.native_counter(report, totals):
        if report is not None:
            _progress.count_writer(writer, totals)
        yield


# -- asynchronous save ----------------------------------------------------------------------
# One background thread per process runs the saves of async_save, one at a time, in the order
# of the calls (every rank calls in the same order, so their exchanges pair up), on a gloo
# group of their own. save(), load() and async_save() first wait for the one in flight: one
# staged copy and one set of writes at a time, and a load sees what the save committed.

_async_lock = threading.Lock()
_async_lane: ThreadPoolExecutor | None = None
_async_last: Future[Metadata] | None = None


def _forget_async_after_fork() -> None:
    # A forked child has no save thread and no save in flight.
    global _async_lock, _async_lane, _async_last
    _async_lock = threading.Lock()
    _async_lane = None
    _async_last = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_async_after_fork)


def _settle_async() -> None:
    """Waits for this process's async save in flight, if any (its outcome stays in its
    future, which its caller holds)."""
    with _async_lock:
        last = _async_last
    if last is not None:
        try:
            last.result()
        except Exception:
            pass


def async_save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    check_replicas: bool | Literal["sample", "full"] = True,
    progress: _progress.ProgressArg = False,
    **writer_options: Any,
) -> Future[Metadata]:
    """:func:`save` in the background: returns once ``state_dict`` is copied (GPU tensors into
    pinned host memory, CPU tensors and other values as copies), so training may change it
    while the copy is written. The future completes with the DCP ``Metadata`` once the
    checkpoint is committed, or fails with the exception :func:`save` would raise.

    Plans are cached as for :func:`save` (DCP's ``async_save`` gathers every rank's plan on
    every save). The save's exchanges run on a gloo group of its own over the ranks of
    ``process_group`` (made by the first call, which every rank of the group must make at the
    same point), so the training's collectives go on meanwhile, on any group. Every rank must
    call it, in the same order as its other saves and loads; a call first waits for the
    previous async save of this process to end (as do :func:`save` and :func:`load`), so at
    most one is in flight and one staged copy is held. The save thread is joined at the
    interpreter's exit: a save in flight completes first, unless the process group is destroyed
    before (``dist.destroy_process_group()``): the save then fails with a
    :class:`pyckpt.PyckptError` saying so, also logged (nobody may wait for it any more), and
    commits nothing after that point. Wait for the future before destroying the group.

    A staging failure on one rank (a :class:`pyckpt.CudaError` naming the tensor) writes
    nothing on any rank: every rank's future fails, on that rank with its own error and on
    the others with a note naming it.

    Args: as for :func:`save`; ``progress`` counts the background writes (the bar is drawn,
        and the callback called, from pyckpt's background threads).

    Raises:
        ValueError: Invalid writer options (on this thread, before staging).
        TypeError: ``progress`` is neither a bool nor a callable (on this thread).
    """
    global _async_lane, _async_last
    # Checks its type now (True would open the bar here: the save thread opens it).
    _progress.resolve(False if isinstance(progress, bool) else progress, "save")
    _settle_async()
    # Its own gloo group over the ranks (made once): the save's exchanges run on the save
    # thread while the training's go on, on whatever group, in the calling thread.
    group = own_group(process_group, "async_save")
    writer = Writer(path, **writer_options)
    staged: Any = None
    failed: BaseException | None = None
    try:
        with _gc.paused():
            staged = writer.stage(_stateful.to_save(state_dict))
    except Exception as e:  # every rank learns it in the save's first exchange
        failed = e
    except BaseException:  # Ctrl-C: nothing is submitted
        writer.close()
        raise
    with _async_lock:
        if _async_lane is None:
            _async_lane = _background.lane("pyckpt-async-save")
        fut = _async_lane.submit(_save_staged, staged, writer, group, check_replicas, progress,
                                 failed)
        _async_last = fut
    return fut


def _save_staged(staged: Any, writer: Writer, group: Group,
                 check_replicas: bool | Literal["sample", "full"], progress: _progress.ProgressArg,
                 failed: BaseException | None) -> Metadata:
    path = writer.path
    # The staged copy's memory goes back when the save ends: a successful write returns it
    # already; a failed save's copy would stay leased as long as its exception (the traceback
    # holds this frame) and the next save would allocate (page-lock) more.
    staging = writer._native.made_staging()
    try:
        with _gc.paused(), peer_errors(group.pg, "pyckpt.async_save"), writer, \
                _typed_errors(), _save_progress(progress, writer, group.pg):
            return _savedrive.save(staged, writer, SavePlanner(check_replicas=check_replicas),
                                   group, failed=failed)
    except Exception as e:
        if not group.distributed or dist.is_initialized():
            raise
        # dist.destroy_process_group() with the save in flight (the end of a training script):
        # nobody waits for this future any more, so the loss is also said on stderr.
        lost = PyckptError(
            f"pyckpt.async_save of {path!r} stopped: torch.distributed's process group was "
            "destroyed while the save was in flight; unless its commit came first, no new "
            "checkpoint was saved there (wait for the future, fut.result(), before "
            "dist.destroy_process_group())")
        logger.error("%s", lost)
        raise lost from e
    finally:
        if staging is not None:
            staging.release_all()


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    trusted: bool = False,
    storage_options: dict[str, Any] | None = None,
    shared_filesystem: bool | Literal["auto"] = True,
    progress: _progress.ProgressArg = False,
    cooperative: bool | None = None,
    allow_partial: bool = False,
) -> None:
    """Loads the checkpoint at ``path`` into ``state_dict`` in place with DCP.

    Non-tensor values (DCP ``BYTE_IO`` items: step counters, RNG states, anything DCP stored
    with ``torch.save``) are unpickled with ``torch.load(..., weights_only=True)`` unless
    ``trusted=True``. Note that ``dcp.load`` with DCP's ``DefaultLoadPlanner`` (torch 2.13)
    unpickles them with ``weights_only=False``, which runs whatever code a crafted pickle holds.

    Any world size can load any checkpoint: each rank reads only the byte ranges of the stored
    pieces that overlap what its state dict holds, including items a save split across ranks.
    Planning uses :class:`pyckpt.LoadPlanner`: a rank finds the pieces it needs through an index
    built when the metadata is read, so its planning does not grow with the saving world size.

    Args:
        state_dict: The state dict to fill; its tensors (or DTensors) give the shapes and the
            placement to load into. Top-level modules, optimizers, generators and other
            ``Stateful`` values are loaded into and updated in place (see :func:`save`); a fresh
            optimizer's state is created first, so its moments are loaded.
        path: Checkpoint directory written by :func:`save` or ``dcp.save`` with
            :class:`pyckpt.Writer`.
        process_group: Process group of the load (default: the default group, if any); as
            for :func:`save`, coordination runs on :func:`pyckpt.coordination_group` of it.
        trusted: Unpickle non-tensor values with ``weights_only=False`` (DCP's default): only
            for checkpoints from a trusted source, whose values hold other Python types.
        storage_options: for an ``s3://`` path: client settings overriding the ``AWS_*``
            environment and ``~/.aws`` files (see docs/OBJECT_STORES.md).
        shared_filesystem: False for a node-local checkpoint (saved with
            ``shared_filesystem=False``): each rank reads its own ``path`` and fetches chunks
            held by other ranks over ``process_group`` (see :class:`pyckpt.Reader`);
            ``"auto"`` lets the ranks find out (one all-gather of the files each sees).
        progress: as for :func:`save` (the bytes of this rank's state dict).
        cooperative: True: stored bytes several ranks load (replicated state) are read from
            storage once, by one rank, and shared over ``process_group`` (see
            :class:`pyckpt.Reader`); False: every rank reads all it loads itself. Default
            ``PYCKPT_COOPERATIVE``, else decided per load: on for ``s3://``, node-local
            checkpoints and ranks on several nodes loading the same bytes; off when every rank
            is on one node reading a directory (docs/REPLICATED.md).
        allow_partial: load what ``state_dict`` asks for even when that leaves stored entries
            behind under a key it holds. By default such a load raises
            :class:`pyckpt.PartialLoadError` before loading anything: the usual cause is a
            fresh optimizer's ``state_dict()``, whose empty ``state`` asks for no moments
            (build the state with ``torch.distributed.checkpoint.state_dict.get_state_dict``
            instead). Keys ``state_dict`` does not hold at all (loading only ``"model"``) are
            never an error.

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint or a data file is missing.
        pyckpt.CheckpointFormatError: invalid metadata, unknown format version, truncated
            data; :class:`pyckpt.ChecksumError` for corrupted chunks (naming file and tensor).
        pyckpt.CheckpointFormatError: also when a non-tensor value's pickle holds types outside
            torch's weights-only allowlist and ``trusted`` is false (names the item).
        RuntimeError: a key of ``state_dict`` is missing from the checkpoint (DCP's error).
        ValueError: a tensor's size differs from the stored one (DCP's error).
        pyckpt.PartialLoadError: stored entries would be left behind (see ``allow_partial``).
        Errors are the lowest failing rank's own exception, re-raised from DCP's
        ``CheckpointException`` (attached as ``__cause__``).
    """
    _settle_async()  # a load after an async save sees what it committed
    process_group = coordination_arg(process_group)  # as in save()
    reader_options = {"shared_filesystem": shared_filesystem, "process_group": process_group,
                      "storage_options": storage_options, "cooperative": cooperative,
                      "allow_partial": allow_partial}
    with _gc.paused():  # as in save()
        dest, apply = _stateful.to_load(state_dict)
        _load(dest, path, process_group, trusted, reader_options, progress)
        apply()


def _load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    process_group: Any,
    trusted: bool,
    reader_options: dict[str, Any],
    progress: _progress.ProgressArg,
) -> None:
    with peer_errors(process_group, "pyckpt.load"), _typed_errors(), \
            Reader(path, **reader_options) as reader, _bounded_if_node_local(reader), \
            _single_process_quiet(), _quiet_missing_metadata(), \
            _progress.job(progress, "load", process_group) as report, \
            _progress.native_counter(report, _progress.local_bytes(state_dict) if report else 0):
        # Several ranks: DCP's steps with the global plan cached (pyckpt._loaddrive), unless
        # the checkpoint needs DCP's own path (rank-local metadata, or an error to report).
        _loaddrive.run(state_dict, reader, load_planner(trusted), group_info(process_group),
                       (trusted,))
