"""``pyckpt.CheckpointManager``: a node-local fast tier with peer replicas, a durable tier
written in the background, retention, and restore from the newest complete step.

See docs/TIERS.md for the tiers, the commit rule of each, and the failures each configuration
survives. The file operations live in :mod:`pyckpt._tier_io`, the replica transfers in
:mod:`pyckpt._replicate`; this module decides what happens when.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pyckpt import _format, _knobs, _stateful
from pyckpt._collective import Group, add_note, agree, all_gather, peer_errors, peer_group, portable
from pyckpt._replicate import DEFAULT_WINDOW, node_order, replicate, ring_targets
from pyckpt._tensors import local_view
from pyckpt._tier_io import DAMAGED_SUFFIX, DurableTier, LocalTier, StepView
from pyckpt.api import _single_process_quiet, _typed_errors, load_planner
from pyckpt.backends import SaveState
from pyckpt.errors import (
    CheckpointFormatError,
    CompressionError,
    JobMismatchError,
    PyckptError,
    StepMismatchError,
    TierBudgetError,
    TierWarning,
    find_error,
)
from pyckpt.planner import SavePlanner
from pyckpt.storage import Reader, Writer

__all__ = ["CheckpointManager", "SaveInfo", "RestoreInfo", "node_identity"]

logger = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., Any])


def _local_path(local: str | os.PathLike[str], node: str) -> str:
    """The fast tier's directory of ``node``: ``local`` with ``{node}`` replaced by its id."""
    path = os.fspath(local)
    if "{node}" in path and (not node or os.sep in node or node in (".", "..")):
        raise ValueError(f"local={path!r}: node id {node!r} cannot be part of a path")
    return path.replace("{node}", node)


def node_identity(node: str | int | None = None) -> str:
    """This process's node id: ``node`` when given; else :func:`pyckpt._knobs.node_id`
    (torchrun's ``GROUP_RANK`` when torchrun's variables are set, else the host name), the
    nodes cooperative loads go by too."""
    return str(node) if node is not None else _knobs.node_id()


@dataclass
class SaveInfo:
    """What one fast-tier (or durable-only) save did, on this rank.

    Attributes:
        step: the step saved.
        blocking_s: time :meth:`CheckpointManager.save` held the caller (staging included).
        write_s: the node-local (or durable) save in the background.
        replication_s: sending and receiving the replicas, checking and committing them.
        bytes_sent / bytes_received: replica bytes this rank sent / received over the group.
        footprint_bytes: the fast tier's bytes on this node after the save and retention.
    """

    step: int
    blocking_s: float = 0.0
    write_s: float = 0.0
    replication_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    footprint_bytes: int = 0


@dataclass
class RestoreInfo:
    """Where a restore's bytes came from, on this rank.

    Attributes:
        step: the step restored (None: nothing to restore).
        tier: ``"fast"`` (this node's files and peers' replicas) or ``"durable"``.
        bytes_local: stored bytes read from this node's fast tier.
        bytes_peer: stored bytes received from other ranks over the group.
        bytes_durable: bytes read from the durable tier (data files).
        fast_tier_lacked: why the fast tier could not serve a newer step (None when it served).
        skipped: damaged copies (and steps) the restore skipped for the next good source, one
            sentence each, naming the node and the file (each also a ``TierWarning``).
    """

    step: int | None
    tier: str | None = None
    bytes_local: int = 0
    bytes_peer: int = 0
    bytes_durable: int = 0
    fast_tier_lacked: str | None = None
    skipped: list[str] = field(default_factory=list)


#: Seconds a restore waits for the durable tier's listing (retries included) when the fast
#: tier has a complete step to restore: a durable store that is down or frozen does not hold up
#: a recovery the fast tier can serve.
DURABLE_LIST_DEADLINE_S = 10.0


def _damage(exc: BaseException) -> bool:
    """Whether a failed fast-tier load may be a damaged copy (a checksum, format or I/O error
    of a file), rather than a lost peer or an interrupt."""
    return find_error(exc, (CheckpointFormatError, CompressionError, OSError)) is not None


@dataclass
class _FastStep:
    save_id: str
    files: dict[str, int]
    holders: dict[str, list[str]] = field(default_factory=dict)


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors ``state`` holds in this process (an upper bound on what this rank
    writes: stored chunks are never larger than raw, and replicated tensors are split)."""
    from torch.utils._pytree import tree_flatten

    total = 0
    for leaf in tree_flatten(state)[0]:
        if isinstance(leaf, torch.Tensor):
            t = local_view(leaf)
            total += t.numel() * t.element_size()
    return total


# (ranks, purpose) -> weak references to (the default group it was made under, the gloo group).
# Groups are kept for the life of the default group and reused by later managers: destroying a
# subgroup makes torch give the next one over the same ranks the same store prefix as an
# earlier one, whose stale keys then break its rendezvous. Weak: torch's registry keeps a group
# until destroy_process_group(), which then frees it (with the managers that used it); a strong
# reference here would keep it until the interpreter finalizes, where tearing down a gloo group
# can abort a process whose work is done.
_GROUPS: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = {}
_GROUPS_LOCK = threading.Lock()


def _own_group(process_group: Any, purpose: str) -> Group:
    """A gloo group over the ranks of ``process_group`` (or one process), for the manager's
    background collectives, so they never interleave with the training's on its group.

    Bounded as every exchange of pyckpt (:func:`pyckpt._collective.peer_group`): DCP's
    collectives on it wait ``PYCKPT_PEER_TIMEOUT`` at most, pyckpt's own up to the job's
    timeout for ranks that still beat; a frozen or dead rank raises ``PeerLostError`` naming it
    (:func:`_peer_typed`)."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return Group(None, 0, 1, False)
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    world = dist.group.WORLD
    with _GROUPS_LOCK:
        made = _GROUPS.get((ranks, purpose))
        pg = None if made is None or made[0]() is not world else made[1]()
        if pg is None:
            pg = peer_group(list(ranks))
            _GROUPS[(ranks, purpose)] = (weakref.ref(world), weakref.ref(pg))
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg), True)


def _peer_typed(group: str, what: str) -> Callable[[_F], _F]:
    """Decorates a method of :class:`CheckpointManager` whose collectives run on its group
    ``group`` (an attribute): the transport's report of a lost peer, raised by DCP's collectives
    there, becomes ``PeerLostError`` naming the rank (pyckpt's own raise it already)."""
    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
            with peer_errors(getattr(self, group).pg, what):
                return method(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


class CheckpointManager:
    """Saves a training's state every ``save_every`` steps into a node-local fast tier with
    peer replicas, persists every ``persist_every`` steps to a durable tier in the background,
    keeps the newest complete steps, and restores the newest step complete in any tier.

    Args:
        durable: the durable tier: any pyckpt location (a directory, shared or not,
            ``s3://bucket/prefix``, ``memory://name``). Step ``N`` is the pyckpt checkpoint
            ``<durable>/step-<N>`` (``pyckpt.load`` reads it), reached through its backend.
        local: the fast tier's directory on each node (e.g. ``/dev/shm/pyckpt``; the same path
            on every node, never shared between nodes). ``{node}`` in it is replaced by this
            rank's node id, for nodes that share a file system (several "nodes" on one
            machine: ``/dev/shm/pyckpt/node-{node}``). None: every save goes to ``durable``.
        replicas: copies of each node's fast-tier files kept on other nodes (0 .. nodes-1).
        save_every: :meth:`save` writes steps that are multiples of this (others are no-ops).
        persist_every: saved steps that are multiples of this are also copied to ``durable``.
        keep_local / keep_durable: complete steps kept per tier (>= 1); older ones are deleted
            only once a newer step is complete there.
        compression: ``"zstd"`` or None (see :class:`pyckpt.Writer`).
        process_group: the group of the training's ranks (default: the default group). The
            manager makes its own gloo groups over the same ranks for its background work.
        node: this rank's node id (default: :func:`node_identity`).
        local_budget_bytes: the most bytes the fast tier may hold on a node; a save that could
            exceed it raises :class:`pyckpt.TierBudgetError` before writing. The estimate per
            node is the present footprint + the raw bytes of the node's ranks' state + those of
            the nodes it keeps replicas of (retention runs only after a save completes, so the
            budget must hold ``keep_local + 1`` steps).
        storage_options: client settings for an ``s3://`` durable tier.
        fsync: fsync data and metadata (default ``PYCKPT_FSYNC`` or True).
        replication_window_bytes: replica bytes each rank sends per round (memory bound).
        check_replicas: see :func:`pyckpt.save`.
        writer_options: more :class:`pyckpt.Writer` options (``threads``, ``chunk_bytes``, ...).
        job: this training job's name, the same on every restart of it. The durable tier
            records the first named job that uses it (``<durable>/pyckpt-job/pyckpt.json``);
            a manager of another job (or of none) is refused there with
            :class:`pyckpt.JobMismatchError` (at the first restore or persistence; at
            construction without ``local``), so no job restores or deletes another's steps.
            None: no marker is written, and a tier a named job holds is refused.

    Raises:
        ValueError: invalid arguments, or ``replicas`` not below the number of nodes.
        JobMismatchError: without ``local``, the durable tier belongs to another job.

    Collective: the constructor, :meth:`save` (for due steps), :meth:`restore`, :meth:`wait`
    and :meth:`close` must be called by every rank of the group at the same points.

    Thread-safety: one thread drives a manager; its background work runs on two threads of its
    own (fast tier; durable tier), each with its own process group.
    """

    def __init__(
        self,
        durable: str | os.PathLike[str],
        local: str | os.PathLike[str] | None = None,
        replicas: int = 1,
        save_every: int = 1,
        persist_every: int = 10,
        keep_local: int = 2,
        keep_durable: int = 3,
        compression: str | None = "zstd",
        process_group: Any = None,
        node: str | int | None = None,
        *,
        local_budget_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        fsync: bool | None = None,
        replication_window_bytes: int = DEFAULT_WINDOW,
        check_replicas: bool | str = True,
        writer_options: Mapping[str, Any] | None = None,
        job: str | None = None,
    ) -> None:
        for name, value, low in (("replicas", replicas, 0), ("save_every", save_every, 1),
                                 ("persist_every", persist_every, 1),
                                 ("keep_local", keep_local, 1), ("keep_durable", keep_durable, 1),
                                 ("replication_window_bytes", replication_window_bytes, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if local_budget_bytes is not None and local_budget_bytes < 0:
            raise ValueError(f"local_budget_bytes must be >= 0, got {local_budget_bytes}")
        from pyckpt import _knobs

        self.save_every = save_every
        self.persist_every = persist_every
        self.keep_local = keep_local
        self.keep_durable = keep_durable
        self.local_budget_bytes = local_budget_bytes
        self.replication_window_bytes = replication_window_bytes
        self.check_replicas = check_replicas
        self._fsync = _knobs.fsync() if fsync is None else bool(fsync)
        self.store = DurableTier(durable, storage_options, self._fsync, job)
        self.node = node_identity(node)
        self.tier = None if local is None else LocalTier(_local_path(local, self.node),
                                                         self._fsync)
        self._group = _own_group(process_group, "fast")
        self._persist_group = (_own_group(process_group, "persist") if self.tier is not None
                               else self._group)
        self.nodes: list[str] = all_gather(self.node, self._group)
        self.replicas = replicas if self.tier is not None else 0
        if self.tier is not None:
            try:
                ring_targets(self.nodes, self.replicas)  # same ValueError on every rank
            except ValueError as e:
                raise ValueError(
                    f"{e} (node ids {node_order(self.nodes)}): use replicas=0 (no copies on "
                    "other nodes), or, for several processes on one machine standing for "
                    "several nodes, give each its own node id with node= (e.g. "
                    "node=os.environ['LOCAL_RANK']) and its own fast-tier directory with "
                    "{node} in local (e.g. local='/dev/shm/pyckpt/node-{node}')") from None
        me = self._group.rank
        self._leader = me == min(r for r, n in enumerate(self.nodes) if n == self.node)
        options = dict(writer_options or {})
        options.setdefault("fsync", self._fsync)
        self._fast_writer = (None if self.tier is None else
                             Writer(self.tier.root, compression, shared_filesystem=False,
                                    **options))
        self._durable_writer = (None if self.tier is not None else
                                Writer(self.store.url, compression,
                                       storage_options=self.store.storage_options or None,
                                       **options))
        self._save_ex = ThreadPoolExecutor(1, thread_name_prefix="pyckpt-manager-save")
        self._persist_ex = ThreadPoolExecutor(1, thread_name_prefix="pyckpt-manager-persist")
        self._fast_future: Future[int] | None = None
        self._persist_future: Future[int | None] | None = None  # the newest persistence task
        self._pinned_lock = threading.Lock()  # guards the fields below (several threads)
        self._failures: list[BaseException] = []  # background failures not raised yet
        self._notices: list[str] = []  # TierWarnings of background work, for the caller
        # Fast-tier steps due for the durable tier and not started: (step, files, holders).
        # At most one (a newer due step supersedes it), so a stuck persistence never holds
        # more than two fast-tier steps (its own and the pending one) from retention.
        self._pending: list[tuple[int, dict[str, int], dict[str, list[str]]]] = []
        self._in_flight: int | None = None  # the step being persisted
        self._closed = False
        self.last_save: SaveInfo | None = None
        self.last_restore: RestoreInfo | None = None
        self.last_persisted: int | None = None
        if self.tier is None:  # durable only: refuse another job's tier before any save
            agree(self.store.check_job, self._group, ranks="root",
                  what=f"checking the job of {self.store.url}")

    # -- public API --------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, force: bool = False) -> Future[int] | None:
        """Saves ``state`` as ``step`` when it is due (``step % save_every == 0``, or
        ``force``). ``state`` is a state dict whose top-level values may be the model and
        optimizer themselves (``{"model": model, "optim": optim, "step": step}``): they are
        saved through ``torch.distributed.checkpoint.state_dict`` (see :func:`pyckpt.save`),
        which is what :meth:`restore` loads them through. Returns once the state is staged (copied; training may go on), with a future
        that completes (with ``step``) when the step is complete in the fast tier (or, without
        one, in the durable tier). Returns None for a step that is not due.

        A save first waits for the previous one's fast-tier work, never for the durable tier:
        when a persistence is still running (a slow or unreachable store) as a newer step
        becomes due, that step waits as the one pending persistence, and a newer due step
        supersedes a pending one (a :class:`pyckpt.TierWarning` names both; ``last_persisted``
        is the newest step committed there). Failures of earlier background work (fast-tier
        saves and persistences) are raised here or by :meth:`wait` (see :meth:`wait`); a
        save that raises them has saved nothing: a note on the exception says "step N was not
        saved".

        Every rank must pass the same ``step``: the ranks compare their steps in the first
        exchange of the background work, and on disagreement every rank's future fails with
        :class:`pyckpt.StepMismatchError` (naming each rank's step) before anything is written
        in any tier; a step complete before stays as it was.

        Saving a step that is already complete in the fast tier again writes the new copy aside
        (``<local>/.resave``) and puts it in place only once it is complete on every node, so
        a failure or crash during the new save leaves the old copy restorable.

        The only work done before returning is the staging copy (no collective): the ranks
        exchange their staging outcome as the first step of the background work. A staging
        failure on any rank (a :class:`pyckpt.CudaError` naming the tensor) writes nothing on
        any rank: every rank's future fails with it (on the other ranks with a note naming the
        failing rank) and every rank's next :meth:`save` or :meth:`wait` raises it.

        Raises:
            TierBudgetError: the save would take a node's fast tier over ``local_budget_bytes``
                (on every rank, before anything is written).
        """
        self._check_open()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not force and step % self.save_every:
            return None
        t0 = time.perf_counter()
        self._settle(self._fast_future)
        self._warn_notices()
        self._raise_failure(f"pyckpt: step {step} was not saved (this save() raised a failure "
                            "of earlier background work instead; call save() again)")
        info = SaveInfo(step)
        if self.tier is not None:
            assert self._fast_writer is not None
            self._check_budget(state)
            writer, work = self._fast_writer, self._fast_save
        else:
            assert self._durable_writer is not None
            writer, work = self._durable_writer, self._durable_save
        # No collective here: the ranks learn each other's staging outcome in the background
        # work's first agreement (a failure there fails every rank's future the same way, and
        # every rank raises it at the same later call), so the caller waits only for the copies.
        staged, error = None, None
        try:
            staged = writer.stage(_stateful.to_save(state))
        except Exception as e:
            error = e
        fut = self._save_ex.submit(work, step, staged, error, info)
        info.blocking_s = time.perf_counter() - t0
        self._fast_future = fut
        return fut

    @_peer_typed("_group", "CheckpointManager.restore")
    def restore(self, state: Any, *, allow_partial: bool = False) -> int | None:
        """Loads the newest step complete in any tier into ``state`` (in place); returns the
        step, or None when no tier holds a complete step.

        ``state`` is what :meth:`save` was given: a state dict whose top-level models and
        optimizers (``{"model": model, "optim": optim, "step": 0}``) are loaded through
        ``torch.distributed.checkpoint.state_dict`` (a fresh optimizer's state is created
        first, so its moments are loaded) and updated in place, as are other ``Stateful``
        values and the top-level values of ``state``. A load that would leave stored entries
        unloaded under a key ``state`` holds (a fresh ``optim.state_dict()``, whose ``state``
        is empty) raises :class:`pyckpt.PartialLoadError` on every rank before loading
        anything, unless ``allow_partial``.

        The ranks agree on what each sees (one all-gather): a fast-tier step counts when its
        completion marker survives on some node and every data file is held by a surviving
        node; it is read from this node's files first, then from peers over the group. A
        durable step newer than every such step is read from the durable tier; then, with a
        fast tier configured, a :class:`pyckpt.TierWarning` names the step and what the fast
        tier lacked, and data files of that step still held by some node are read from there
        (only the others are fetched from the durable tier). ``last_restore`` says where this
        rank's bytes came from.

        Damaged fast-tier copies (a data file that does not match its metadata or fails its
        checksums, an unreadable ``pyckpt.json``) are set aside on their node as
        ``<name>.damaged``, each named in a :class:`pyckpt.TierWarning` and in
        ``last_restore.skipped``, and the next good source is used: the replica on another
        node, else an older complete step or the durable tier. When the fast tier has a
        complete step, the durable listing gives up after :data:`DURABLE_LIST_DEADLINE_S`; a
        durable tier that could not be listed is named in a ``TierWarning`` and the fast-tier
        step is restored.

        Raises:
            JobMismatchError: the durable tier belongs to another job (see ``job``).
            PartialLoadError: see above.
        """
        self._check_open()
        self._drain()
        dest, apply = _stateful.to_load(state)
        skipped: list[str] = []
        all_views = self._gather_views(skipped)
        fast, lacked = self._fast_steps(all_views)
        durable_steps, unlisted = self._list_durable(bool(fast))
        if unlisted is not None:
            warnings.warn(TierWarning(
                f"pyckpt: the durable steps of {self.store.url} could not be listed within "
                f"{DURABLE_LIST_DEADLINE_S:g} s ({unlisted}); restoring the newest complete "
                "fast-tier step (a newer durable step may exist)"), stacklevel=2)
        failed: set[int] = set()  # fast-tier steps that could not be loaded whole
        while True:
            best_fast = max(fast) if fast else None
            best_durable = durable_steps[-1] if durable_steps else None
            if best_fast is None and unlisted is not None:
                # Every fast-tier candidate failed: the durable tier is all that is left.
                durable_steps, unlisted = self._list_durable(False)
                continue
            if best_fast is None and best_durable is None:
                self.last_restore = RestoreInfo(None, fast_tier_lacked=lacked, skipped=skipped)
                return None
            if best_fast is not None and (best_durable is None or best_fast >= best_durable):
                try:
                    info = self._load_fast(dest, best_fast, fast[best_fast].save_id,
                                           allow_partial)
                except Exception as e:
                    if not _damage(e):
                        raise
                    found = self._set_aside_damaged(best_fast, e)
                    skipped.extend(found)
                    if not found:
                        failed.add(best_fast)
                        skipped.append(f"fast-tier step {best_fast} could not be loaded: "
                                       f"{type(e).__name__}: {e}")
                    warnings.warn(TierWarning(
                        f"pyckpt: restoring fast-tier step {best_fast} failed: "
                        + "; ".join(found or skipped[-1:]) + "; trying the next source"),
                        stacklevel=2)
                    all_views = self._gather_views(skipped)
                    fast, lacked = self._fast_steps(all_views)
                    for f in failed:
                        fast.pop(f, None)
                    continue
            else:
                assert best_durable is not None
                if self.tier is not None:
                    warnings.warn(TierWarning(
                        f"pyckpt: restoring step {best_durable} from the durable tier "
                        f"{self.store.step_location(best_durable)}: {lacked}"), stacklevel=2)
                info = self._load_durable(dest, best_durable, all_views, allow_partial)
                info.fast_tier_lacked = lacked if self.tier is not None else None
            break
        info.skipped[:0] = skipped
        apply()
        self._drop_newer(info.step)
        self.last_restore = info
        return info.step

    def wait(self) -> None:
        """Waits for every save and persistence in flight, then raises the failures of
        background work not raised yet, every one: the first (its own type) with a note naming
        each later one (e.g. two failed persistences: both steps are named). Each failed
        persistence's note names its step and the newest durable step, ``last_persisted``.
        A failure is raised once (by this, :meth:`save` or :meth:`close`)."""
        self._settle(self._fast_future)
        fut = self._persist_future  # the newest: the tasks run one at a time, in order
        if fut is not None:
            wait_futures([fut])
        self._warn_notices()
        self._raise_failure()

    def close(self) -> None:
        """Waits for the work in flight (raising the failures not raised yet, as :meth:`wait`),
        then releases the threads and buffers. Idempotent. (The manager's gloo groups stay for later managers over the same
        ranks; they end with the default process group.)"""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._save_ex.shutdown(wait=True)
            self._persist_ex.shutdown(wait=True)
            for w in (self._fast_writer, self._durable_writer):
                if w is not None:
                    w.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def footprint(self) -> int:
        """Bytes the fast tier holds on this node now (0 without a fast tier)."""
        return 0 if self.tier is None else self.tier.footprint()

    def steps(self) -> dict[str, list[int]]:
        """Complete steps this rank sees: ``{"local": [...], "durable": [...]}`` (not
        collective: the fast tier as marked on this node)."""
        local = [] if self.tier is None else [
            s for s in self.tier.steps() if self.tier.read_marker(s) is not None]
        durable = sorted(s for s, done in self.store.list_steps().items() if done)
        return {"local": local, "durable": durable}

    # -- background work ---------------------------------------------------------------------

    @_peer_typed("_group", "a fast-tier save")
    def _fast_save(self, step: int, staged: Any, staging_error: BaseException | None,
                   info: SaveInfo) -> int:
        tier, g = self.tier, self._group
        assert tier is not None and self._fast_writer is not None
        t0 = time.perf_counter()

        def check() -> tuple[int, bool]:
            if staging_error is not None:
                raise staging_error
            return step, self._leader and tier.read_marker(step) is not None

        # The first exchange: staging outcomes, the step of every rank (nothing is written
        # before they agree), and whether some node already holds this step complete.
        _, seen = agree(check, g, what=f"staging the state for fast-tier step {step}")
        _check_steps([s for s, _ in seen])
        resave = any(done for _, done in seen)
        # A step complete somewhere is saved again aside and moved in place at the commit.
        work = tier.resave_tier() if resave else tier
        agree(lambda: work.prepare(step) if self._leader else None, g,
              what=f"preparing fast-tier step {step}")
        path = work.ensure(step)  # the node's leader made it: this only checks
        with _single_process_quiet(), _typed_errors():
            dcp.save(staged, storage_writer=self._fast_writer, checkpoint_id=path,
                     planner=SavePlanner(check_replicas=self.check_replicas),  # type: ignore[arg-type]
                     process_group=g.pg)
        info.write_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        index = _format.read_index(path, all_files=False)
        own = [(n, os.path.join(path, n)) for n in sorted(index.local_files)
               if _format.data_file_rank(n) == g.rank]
        stats = replicate(g, work, step, own, self.nodes, self.replicas,
                          self.replication_window_bytes)
        info.bytes_sent, info.bytes_received = stats.bytes_sent, stats.bytes_received
        holders = self._confirm_copies(step, index, work)
        record = {"save_id": index.save_id, "replicas": self.replicas,
                  "nodes": node_order(self.nodes), "holders": holders}

        def commit() -> list[int] | None:
            if not self._leader:
                return None
            work.write_marker(step, record)
            if resave:
                tier.replace(step, work)
            return [s for s in tier.steps() if tier.read_marker(s) is not None]

        _, marked = agree(commit, g, what=f"committing fast-tier step {step}")
        info.replication_s = time.perf_counter() - t1
        if step % self.persist_every == 0:
            self._queue_persist(step, dict(index.files), holders)
        agree(lambda: self._retain_local(step, [m for m in marked if m is not None])
              if self._leader else None, g, what="deleting old fast-tier steps")
        info.footprint_bytes = tier.footprint()
        self.last_save = info
        return step

    def _confirm_copies(self, step: int, index: _format.CheckpointIndex,
                        work: LocalTier) -> dict[str, list[str]]:
        """Every data file of ``step`` held by ``1 + replicas`` nodes (one all-gather), else a
        PyckptError on every rank; returns file -> nodes holding it."""
        view = work.view(step)
        gathered = all_gather((view.save_id, view.present), self._group)
        holders: dict[str, set[str]] = {n: set() for n in index.files}
        for r, (_, present) in enumerate(gathered):
            for n in present:
                if n in holders:
                    holders[n].add(self.nodes[r])
        short = sorted(n for n, h in holders.items() if len(h) < 1 + self.replicas)
        others = sorted({sid for sid, _ in gathered if sid != index.save_id}, key=str)
        if short or others:
            raise PyckptError(
                f"fast-tier step {step} ({work.step_dir(step)}) is not complete: "
                + (f"data files with fewer than {1 + self.replicas} copies: {short}; "
                   if short else "")
                + (f"nodes holding metadata of other saves: {others}" if others else ""))
        return {n: sorted(h) for n, h in holders.items()}

    # -- persistence -------------------------------------------------------------------------

    def _queue_persist(self, step: int, files: dict[str, int],
                       holders: dict[str, list[str]]) -> None:
        """Makes committed fast-tier step ``step`` the pending persistence (superseding an
        older pending one) and queues a persistence task; never waits for the durable tier."""
        with self._pinned_lock:
            dropped = [s for s, _, _ in self._pending if s != step]
            self._pending = [(step, files, holders)]
            busy = self._in_flight
        for s in dropped:
            self._notice(f"pyckpt: fast-tier step {s} was not persisted to {self.store.url}: "
                         f"step {step} supersedes it (the durable tier was still busy"
                         + (f" persisting step {busy})" if busy is not None else ")"))
        self._persist_future = self._persist_ex.submit(self._persist_next, step)

    def _persist_next(self, due: int) -> int | None:
        """One persistence task (one per due step, run in order on every rank): the ranks
        agree on the newest step every rank has pending (their pending steps can differ for a
        moment: each rank queues a step once its fast-tier commit returns) and persist it;
        pending steps older than it are superseded. None when no step is pending everywhere
        (an earlier task took it, or a later one will)."""
        g, step = self._persist_group, None
        try:
            with self._pinned_lock:
                mine = [s for s, _, _ in self._pending]
            _, lists = agree(lambda: mine, g, what=f"choosing the step to persist ({due} due)")
            common = set(lists[0]).intersection(*lists[1:]) if lists and lists[0] else set()
            if not common:
                return None
            step = max(common)
            with self._pinned_lock:
                superseded = [s for s, _, _ in self._pending if s < step]
                _, files, holders = next(e for e in self._pending if e[0] == step)
                self._pending = [e for e in self._pending if e[0] > step]
                self._in_flight = step
            for s in superseded:
                self._notice(f"pyckpt: fast-tier step {s} was not persisted to "
                             f"{self.store.url}: step {step} supersedes it")
            return self._persist(step, files, holders)
        except Exception as e:
            add_note(e, f"pyckpt: persisting step {step if step is not None else due} to "
                        f"{self.store.url} failed (the newest step persisted by this manager: "
                        f"{self.last_persisted})")
            with self._pinned_lock:
                self._failures.append(e)
            raise
        finally:
            if step is not None:
                with self._pinned_lock:
                    self._in_flight = None

    @_peer_typed("_persist_group", "persisting a step")
    def _persist(self, step: int, files: dict[str, int], holders: dict[str, list[str]]) -> int:
        """Copies fast-tier step ``step`` to the durable tier: each rank uploads the files
        assigned to it (balanced by bytes among the ranks whose node holds the file), then
        rank 0 commits ``pyckpt.json`` there and applies durable retention."""
        tier, g, store = self.tier, self._persist_group, self.store
        assert tier is not None
        states: list[SaveState] = []  # this rank's save set-up (rank 0's: lock / condition)
        document: list[bytes] = []  # rank 0: the metadata, read before any upload
        try:
            loads = [0] * g.world
            mine = []
            for name in sorted(files, key=lambda n: (-files[n], n)):
                ranks = [r for r, n in enumerate(self.nodes) if n in holders[name]]
                r = min(ranks, key=lambda i: (loads[i], i))
                loads[r] += files[name]
                if r == g.rank:
                    mine.append(name)

            def upload() -> None:
                if g.rank == 0:  # the metadata of the very files uploaded (a re-save of this
                    # step moves a new copy in place: its files have other names)
                    with open(tier.file_path(step, _format.METADATA_FILE), "rb") as fh:
                        document.append(fh.read())
                    idx = _format.read_index(tier.step_dir(step), all_files=False,
                                             document=document[0])
                    if dict(idx.files) != files:
                        raise PyckptError(f"fast-tier step {step} ({tier.step_dir(step)}) was "
                                          "saved again before it was persisted; the new copy "
                                          "is persisted instead")
                states.append(store.begin(step, g.rank == 0))
                for name in mine:
                    store.put_file(step, tier.file_path(step, name))

            agree(upload, g, what=f"persisting step {step} to {store.url}")

            def commit() -> None:
                store.commit(step, document[0], files, states.pop())
                self._retain_durable()

            agree(commit, g, ranks="root", what=f"committing step {step} to {store.url}")
            self.last_persisted = step
            return step
        finally:
            for state in states:
                state.end()

    @_peer_typed("_group", "a durable save")
    def _durable_save(self, step: int, staged: Any, staging_error: BaseException | None,
                      info: SaveInfo) -> int:
        g = self._group
        t0 = time.perf_counter()

        def staged_ok() -> int:
            if staging_error is not None:
                raise staging_error
            return step

        _, steps = agree(staged_ok, g, what=f"staging the state for step {step}")
        _check_steps(steps)  # before anything is written
        with _single_process_quiet(), _typed_errors():
            dcp.save(staged, storage_writer=self._durable_writer,
                     checkpoint_id=self.store.step_location(step),
                     planner=SavePlanner(check_replicas=self.check_replicas),  # type: ignore[arg-type]
                     process_group=g.pg)
        info.write_s = time.perf_counter() - t0
        agree(self._retain_durable, g, ranks="root", what="deleting old durable steps")
        self.last_persisted = step
        self.last_save = info
        return step

    # -- retention ---------------------------------------------------------------------------

    def _retain_local(self, newest: int, marked: Sequence[Sequence[int]]) -> None:
        """On this node: keeps the newest ``keep_local`` steps marked on any node (``marked``:
        each node's marked steps, the same list on every rank, so every node keeps the same
        steps and a step whose marker reached only some nodes keeps every copy), ``newest``,
        the steps pending or being persisted and any step newer than ``newest``; deletes the
        rest."""
        tier = self.tier
        assert tier is not None
        steps = tier.steps()
        complete = sorted({s for m in marked for s in m})
        keep = set(complete[-self.keep_local:]) | {newest}
        with self._pinned_lock:
            keep |= {s for s, _, _ in self._pending}
            if self._in_flight is not None:
                keep.add(self._in_flight)
        for s in steps:
            if s not in keep and s < newest:
                tier.remove(s)

    def _retain_durable(self) -> None:
        """Keeps the newest ``keep_durable`` committed durable steps; deletes older steps
        (committed or not). Steps newer than the newest committed one are left alone."""
        listed = self.store.list_steps()
        done = sorted(s for s, c in listed.items() if c)
        if not done:
            return
        keep = set(done[-self.keep_durable:])
        for s in sorted(listed):
            if s not in keep and s < done[-1]:
                self.store.remove(s)

    # -- restore -----------------------------------------------------------------------------

    def _gather_views(self, skipped: list[str]) -> list[dict[int, StepView]]:
        """What every rank sees of its node's fast tier (one all-gather). Copies the scan found
        damaged (a data file that does not match its metadata, a ``pyckpt.json`` that cannot
        be read) are set aside on their node, each named in a ``TierWarning`` and in
        ``skipped``: the views already leave them out."""
        g = self._group
        views: dict[int, StepView] = {}
        error: BaseException | None = None
        try:
            if self.tier is not None:
                views = self.tier.scan()
        except Exception as e:
            error = e
        gathered = all_gather((views, None if error is None else portable(error)), g)
        _raise_any([e for _, e in gathered], g.rank, error, "listing the fast tier")
        all_views = [v for v, _ in gathered]
        tier = self.tier
        found: list[tuple[int, int, str, str, str]] = []  # (rank, step, name, path, why)
        for r, v in enumerate(all_views):
            if self.nodes.index(self.nodes[r]) != r:
                continue  # a node's first rank speaks for it
            for s, view in sorted(v.items()):
                bad = dict(view.damaged)
                if view.metadata_error is not None:
                    bad[_format.METADATA_FILE] = view.metadata_error
                found += [(r, s, n, os.path.join(view.path, n), why)
                          for n, why in sorted(bad.items())]
        if not found or tier is None:
            return all_views

        def set_aside() -> None:
            for r, s, name, _, _ in found:
                if r == g.rank:
                    tier.set_aside(s, name)

        agree(set_aside, g, what="setting damaged fast-tier copies aside")
        for r, s, _, path, why in found:
            line = (f"node {self.nodes[r]!r}: {path} is damaged ({why}); set aside as "
                    f"{path}{DAMAGED_SUFFIX}")
            skipped.append(line)
            warnings.warn(TierWarning(f"pyckpt: fast-tier step {s}: {line}; the restore uses "
                                      "the next good copy"), stacklevel=3)
        return all_views

    def _list_durable(self, have_fast: bool) -> tuple[list[int], str | None]:
        """The committed durable steps (listed by rank 0, after checking the tier's job) and,
        when ``have_fast`` (a fast-tier step to fall back on) and the listing failed or took
        longer than :data:`DURABLE_LIST_DEADLINE_S`, why (with no steps). Without a fast-tier
        step the listing waits the backend's full retry budget and its failure is raised."""
        deadline = DURABLE_LIST_DEADLINE_S if have_fast else None

        def listing() -> tuple[list[int], str | None]:
            try:
                self.store.check_job(deadline)
                listed = self.store.list_steps(deadline)
            except JobMismatchError:
                raise
            except Exception as e:
                if deadline is None:
                    raise
                return [], f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return sorted(s for s, done in listed.items() if done), None

        got, _ = agree(listing, self._group, ranks="root",
                       what=f"listing the durable steps of {self.store.url}")
        assert got is not None
        return got

    def _set_aside_damaged(self, step: int, error: BaseException) -> list[str]:
        """After a failed load of fast-tier ``step``: each node checks its copies of the step
        (``pyckpt.json`` and every data file) and sets aside the damaged ones, so the next
        attempt reads a replica (or, with none left, falls back to an older step or the
        durable tier). Returns sentences naming each copy set aside (the same on every rank)."""
        tier = self.tier
        assert tier is not None

        def check() -> list[str]:
            out: list[str] = []
            if not self._leader:
                return out
            view = tier.view(step)
            bad = dict(view.damaged)
            if view.metadata_error is not None:
                bad[_format.METADATA_FILE] = view.metadata_error
            else:
                bad.update(tier.damaged_files(step))
            for name, why in sorted(bad.items()):
                path = tier.set_aside(step, name)
                out.append(f"node {self.node!r}: {tier.file_path(step, name)} is damaged "
                           f"({why}); set aside as {path}")
            return out

        _, found = agree(check, self._group, what=f"checking fast-tier step {step}'s copies")
        return [line for lines in found for line in lines]

    def _fast_steps(self, views: Sequence[dict[int, StepView]]) -> tuple[dict[int, _FastStep], str]:
        """Fast-tier steps complete considering the surviving nodes, and why the newest step
        the fast tier has any trace of is not (a sentence for the warning)."""
        out: dict[int, _FastStep] = {}
        reasons: dict[int, str] = {}
        for s in sorted({s for v in views for s in v}):
            here = [v[s] for v in views if s in v]
            marks = {v.marker["save_id"] for v in here if v.marker is not None}
            if len(marks) != 1:
                reasons[s] = (f"step {s} has no completion marker on any surviving node (its "
                              "replication or commit did not finish)" if not marks else
                              f"step {s} has markers of different saves")
                continue
            sid = marks.pop()
            files = next((v.files for v in here if v.save_id == sid and v.files), None)
            if files is None:
                reasons[s] = f"step {s}: no surviving node has its metadata"
                continue
            held = {n for v in here for n in v.present}
            missing = sorted(set(files) - held)
            if missing:
                reasons[s] = (f"step {s}: data files {missing} are held by no surviving node "
                              "(every copy was lost)")
                continue
            out[s] = _FastStep(sid, files)
        newest = max(reasons, default=None)
        if newest is not None and (not out or newest > max(out)):
            lacked = reasons[newest]
        elif not any(views):
            lacked = "the fast tier is empty on every node"
        else:
            lacked = "its newest complete step is older"
        return out, lacked

    def _prepare_dirs(self, step: int, save_id: str) -> None:
        """Before a node-local load of ``step``: a node whose copy belongs to another save
        drops it; every rank has the step's directory (empty on a new node)."""
        tier, g = self.tier, self._group
        assert tier is not None

        def drop_stale() -> None:
            if self._leader:
                sid = tier.view(step).save_id
                if sid is not None and sid != save_id:
                    tier.remove(step)

        agree(drop_stale, g, what=f"preparing to restore step {step}")
        agree(lambda: tier.ensure(step), g, what=f"preparing to restore step {step}")

    def _node_local_load(self, state: Any, step: int, info: RestoreInfo,
                         allow_partial: bool) -> None:
        assert self.tier is not None
        g = self._group
        # Not cooperative: each piece comes from this node's copy or from one holder's, and
        # last_restore reports local / peer bytes per rank (a cooperative read would mix them).
        reader = Reader(self.tier.step_dir(step), shared_filesystem=False,
                        process_group=g.pg, cooperative=False, allow_partial=allow_partial)
        with reader, _single_process_quiet(), _typed_errors():
            dcp.load(state, storage_reader=reader, planner=load_planner(),
                     process_group=g.pg)
        info.bytes_peer = reader.bytes_from_peers
        info.bytes_local = max(0, reader.bytes_read - reader.bytes_from_peers)

    def _load_fast(self, state: Any, step: int, save_id: str,
                   allow_partial: bool) -> RestoreInfo:
        info = RestoreInfo(step, "fast")
        self._prepare_dirs(step, save_id)
        agree(lambda: self._node_local_load(state, step, info, allow_partial), self._group,
              what=f"restoring fast-tier step {step}")
        return info

    def _load_durable(self, state: Any, step: int, views: Sequence[dict[int, StepView]],
                      allow_partial: bool) -> RestoreInfo:
        info = RestoreInfo(step, "durable")
        g = self._group
        partial = self.tier is not None and any(v[step].present for v in views if step in v)
        document = None
        if partial:  # are the pieces the nodes still hold of this very save?
            def read_doc() -> tuple[bytes, str, dict[str, int]]:
                assert self.tier is not None
                doc = self.store.read_metadata(step)
                idx = _format.read_index(self.tier.step_dir(step), all_files=False,
                                         document=doc)
                return doc, idx.save_id, dict(idx.files)

            got, _ = agree(read_doc, g, ranks="root", what=f"reading step {step}'s metadata")
            assert got is not None
            document, save_id, files = got
            held = {n for v in views if step in v for n in v[step].present if n in files}
            partial = bool(held)
        if not partial:
            with Reader(self.store.step_location(step), allow_partial=allow_partial,
                        storage_options=self.store.storage_options or None) as reader, \
                    _single_process_quiet(), _typed_errors():
                dcp.load(state, storage_reader=reader, planner=load_planner(),
                         process_group=g.pg)
            nbytes = reader.bytes_fetched or reader.bytes_read
            info.bytes_durable = nbytes
            self.store.count_direct_load(nbytes)
            return info
        # Fetch only the data files no node holds, into the fast tier, then load from there.
        assert self.tier is not None and document is not None
        tier = self.tier
        self._prepare_dirs(step, save_id)
        missing = {n: s for n, s in files.items() if n not in held}
        loads = [0] * g.world
        mine = []
        for name in sorted(missing, key=lambda n: (-missing[n], n)):
            r = min(range(g.world), key=lambda i: (loads[i], i))
            loads[r] += missing[name]
            if r == g.rank:
                mine.append(name)

        def fetch() -> int:
            total = 0
            meta = tier.file_path(step, _format.METADATA_FILE)
            if self._leader and not os.path.exists(meta):
                tier.write_metadata(step, document)
            for name in mine:
                total += self.store.fetch_file(step, name, tier.file_path(step, name))
            return total

        fetched, _ = agree(fetch, g, what=f"fetching step {step}'s lost files from "
                                          f"{self.store.url}")
        info.bytes_durable = fetched or 0
        self._node_local_load(state, step, info, allow_partial)
        return info

    def _drop_newer(self, step: int | None) -> None:
        """After a restore of ``step``: deletes this node's fast-tier steps newer than it (they
        are incomplete; the training will save those steps again)."""
        tier = self.tier
        if tier is None or step is None:
            return

        def drop() -> None:
            if self._leader:
                for s in tier.steps():
                    if s > step:
                        tier.remove(s)

        agree(drop, self._group, what="deleting incomplete fast-tier steps")

    # -- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def _settle(self, fut: Future[int] | None) -> None:
        """Waits for fast-tier save ``fut``; keeps its failure for :meth:`_raise_failure`
        (persistence tasks keep their own)."""
        if fut is None:
            return
        exc = fut.exception()
        with self._pinned_lock:
            if exc is not None and not getattr(fut, "_pyckpt_seen", False):
                self._failures.append(exc)
            fut._pyckpt_seen = True  # type: ignore[attr-defined]

    def _raise_failure(self, note: str | None = None) -> None:
        """Raises the failures kept (each once): the first, with a note naming every later
        one, and ``note``."""
        with self._pinned_lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        exc = failures[0]
        add_note(exc, "pyckpt: raised by CheckpointManager from earlier background work")
        for other in failures[1:]:
            notes = [n for n in getattr(other, "__notes__", []) if n.startswith("pyckpt: ")]
            add_note(exc, f"pyckpt: later background work failed too: {type(other).__name__}: "
                          f"{other}" + (f" ({'; '.join(notes)})" if notes else ""))
        if note is not None:
            add_note(exc, note)
        raise exc

    def _notice(self, message: str) -> None:
        """A TierWarning of background work: logged now, warned in the caller's thread by the
        next :meth:`save` or :meth:`wait` (a warning raised in a background thread, where
        warnings are errors, would fail the work)."""
        logger.warning("%s", message)
        with self._pinned_lock:
            self._notices.append(message)

    def _warn_notices(self) -> None:
        with self._pinned_lock:
            notices, self._notices = self._notices, []
        for message in notices:
            warnings.warn(TierWarning(message), stacklevel=3)

    def _drain(self) -> None:
        """Waits for the work in flight; a failure of it is logged, not raised (a restore is
        what follows a failure)."""
        self._settle(self._fast_future)
        if self._persist_future is not None:
            wait_futures([self._persist_future])
        with self._pinned_lock:
            failures, self._failures = self._failures, []
        for exc in failures:
            logger.warning("pyckpt: a checkpoint save failed before this restore: %r", exc)

    def _check_budget(self, state: Any) -> None:
        if self.local_budget_bytes is None:
            return
        assert self.tier is not None
        g = self._group
        mine = _state_bytes(state)
        footprint = self.tier.footprint() if self._leader else 0
        gathered = all_gather((mine, footprint), g)
        targets = ring_targets(self.nodes, self.replicas)
        projected: dict[str, int] = {n: 0 for n in targets}
        for r, (nbytes, fp) in enumerate(gathered):
            node = self.nodes[r]
            projected[node] += nbytes + fp
            for t in targets[node]:
                projected[t] += nbytes
        for node in node_order(self.nodes):
            if projected[node] > self.local_budget_bytes:
                raise TierBudgetError(
                    f"saving would take the fast tier of node {node!r} ({self.tier.root}) to "
                    f"{projected[node]} bytes, over local_budget_bytes={self.local_budget_bytes}"
                    f" (its present files, its ranks' state and the replicas it keeps); nothing "
                    "was written", node, projected[node], self.local_budget_bytes)


def _check_steps(steps: Sequence[int]) -> None:
    """Raises StepMismatchError (the same on every rank: ``steps`` is every rank's step, as
    gathered) when the ranks passed different steps to one save."""
    if len(set(steps)) <= 1:
        return
    by_step: dict[int, list[int]] = {}
    for r, s in enumerate(steps):
        by_step.setdefault(s, []).append(r)
    said = "; ".join(f"step {s} on rank{'s' if len(rs) > 1 else ''} "
                     f"{', '.join(map(str, rs))}" for s, rs in sorted(by_step.items()))
    raise StepMismatchError(
        f"the ranks passed different steps to CheckpointManager.save ({said}); nothing of this "
        "save was written or committed in any tier (every rank must save the same step)",
        dict(enumerate(steps)))


def _raise_any(errors: Sequence[BaseException | None], me: int, mine: BaseException | None,
               what: str) -> None:
    if mine is not None:
        raise mine
    for r, err in enumerate(errors):
        if err is not None and r != me:
            add_note(err, f"pyckpt: {what} failed on rank {r}")
            raise err

