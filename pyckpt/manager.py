"""``pyckpt.CheckpointManager``: a node-local fast tier with peer replicas, a durable tier
written in the background, retention, and restore from the newest complete step.

See docs/TIERS.md for the tiers, the commit rule of each, and the failures each configuration
survives. The file operations live in :mod:`pyckpt._tier_io`, the replica transfers in
:mod:`pyckpt._replicate`; this module holds the public API, and the work behind it is in
:mod:`pyckpt._manager` (save, persistence, retention, restore).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from pyckpt import _background, _stateful
from pyckpt._collective import agree, all_gather
from pyckpt._manager.groups import own_group, peer_typed
from pyckpt._manager.info import RestoreInfo, SaveInfo, local_path, node_identity
from pyckpt._manager.restore import (
    DURABLE_LIST_DEADLINE_S,
    Restoring,
    damaged,
    lost_or_damaged,
)
from pyckpt._manager.save import Saving
from pyckpt._replicate import DEFAULT_WINDOW, node_order, ring_targets
from pyckpt._tier_io import DurableTier, LocalTier
from pyckpt.errors import TierWarning
from pyckpt.storage import Writer

__all__ = ["CheckpointManager", "SaveInfo", "RestoreInfo", "node_identity"]

for _public in (SaveInfo, RestoreInfo, node_identity):
    _public.__module__ = __name__


class CheckpointManager(Saving, Restoring):
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
            Each node's fast tier is claimed the same way (``<local>/pyckpt-job``, checked at
            construction). None: no marker is written, and a tier a named job holds is refused.

    Raises:
        ValueError: invalid arguments, or ``replicas`` not below the number of nodes.
        JobMismatchError: the fast tier (on any node) or, without ``local``, the durable tier
            belongs to another job.

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
        self.tier = None if local is None else LocalTier(local_path(local, self.node),
                                                         self._fsync)
        self._group = own_group(process_group, "fast")
        self._persist_group = (own_group(process_group, "persist") if self.tier is not None
                               else self._group)
        # Every manager over these ranks saves on the same two lanes (one per group), so two
        # managers' background collectives never run at once on a group: they take turns in
        # the order the training called save(), the same on every rank.
        self._save_ex = _background.shared_lane(self._group.pg, "pyckpt-manager-save")
        self._persist_ex = _background.shared_lane(self._persist_group.pg,
                                                   "pyckpt-manager-persist")
        _background.idle(self._save_ex)  # another manager's save on this group ends first
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
        else:  # a fast tier left by another job (the same local path) is claimed the same way
            fast_job = DurableTier(self.tier.root, None, self._fsync, job, kind="fast tier")
            agree(lambda: fast_job.check_job() if self._leader else None, self._group,
                  what=f"checking the job of the fast tier {self.tier.root}")

    # -- public API --------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, force: bool = False) -> Future[int] | None:
        """Saves ``state`` as ``step`` when it is due (``step % save_every == 0``, or
        ``force``). ``state`` is a state dict whose top-level values may be the model and
        optimizer themselves (``{"model": model, "optim": optim, "step": step}``): they are
        saved through ``torch.distributed.checkpoint.state_dict`` (see :func:`pyckpt.save`),
        which is what :meth:`restore` loads them through. Returns once the state is staged
        (copied; training may go on), with a future that completes (with ``step``) when the
        step is complete in the fast tier (or, without one, in the durable tier). Returns None
        for a step that is not due.

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
        tier = self.tier
        newer = [s for s in tier.steps() if s > step] if tier is not None else []
        if tier is not None and newer:  # a run restarted from an older step, not restore()d
            warnings.warn(TierWarning(
                f"pyckpt: saving step {step} while the fast tier {tier.root!r} holds newer "
                f"steps {newer[:5]} of an earlier run: restore() returns the newest step; "
                "roll back with restore(state, step=...), which deletes the newer steps"),
                stacklevel=2)
        # No collective here but the budget's: the ranks learn each other's staging outcome in
        # the background work's first agreement (a failure there fails every rank's future the
        # same way, and every rank raises it at the same later call), so the caller waits only
        # for the copies.
        staged, error = None, None
        try:
            plain = _stateful.to_save(state)  # models and optimizers as their state dicts
        except Exception as e:
            plain, error = {}, e
        if self.tier is not None:
            assert self._fast_writer is not None
            self._check_budget(plain)  # the tensors the save writes, a model's included
            writer, work = self._fast_writer, self._fast_save
        else:
            assert self._durable_writer is not None
            writer, work = self._durable_writer, self._durable_save
        if error is None:
            try:
                staged = writer.stage(plain)
            except Exception as e:
                error = e
        fut = self._save_ex.submit(work, step, staged, error, info)
        info.blocking_s = time.perf_counter() - t0
        self._fast_future = fut
        return fut

    @peer_typed("_group", "CheckpointManager.restore")
    def restore(self, state: Any, *, step: int | None = None,
                allow_partial: bool = False) -> int | None:
        """Loads the newest step complete in any tier into ``state`` (in place); returns the
        step, or None when no tier holds a complete step.

        ``step``: roll the job back to this step instead (after a loss spike, say): it is
        loaded as above, from whichever tier holds it complete, and once it is loaded every
        newer step is deleted from both tiers, so that a later restore does not return the
        abandoned run's steps. :class:`FileNotFoundError` when no tier holds it complete
        (nothing is deleted then). To read an older step without rolling back, load
        ``pyckpt.load(state, mgr.store.step_location(step))``.

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
            FileNotFoundError: ``step`` is complete in no tier.
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
        first_error: BaseException | None = None  # of a durable step that could not be loaded
        while True:
            if step is not None:  # a rollback: that step or nothing
                fast = {s: v for s, v in fast.items() if s == step}
                durable_steps = [s for s in durable_steps if s == step]
            best_fast = max(fast) if fast else None
            best_durable = durable_steps[-1] if durable_steps else None
            if best_fast is None and unlisted is not None:
                # Every fast-tier candidate failed: the durable tier is all that is left.
                durable_steps, unlisted = self._list_durable(False)
                continue
            if best_fast is None and best_durable is None:
                self.last_restore = RestoreInfo(None, fast_tier_lacked=lacked, skipped=skipped)
                if first_error is not None:  # never None: the training would start over
                    raise first_error
                if step is not None:
                    raise FileNotFoundError(
                        f"pyckpt: step {step} is complete in no tier (fast tier "
                        f"{self.tier.root if self.tier is not None else 'none'}, durable tier "
                        f"{self.store.url}); nothing was loaded or deleted")
                return None
            if best_fast is not None and (best_durable is None or best_fast >= best_durable):
                if fast[best_fast].note is not None:
                    warnings.warn(TierWarning(f"pyckpt: {fast[best_fast].note}"), stacklevel=2)
                try:
                    info = self._load_fast(dest, best_fast, fast[best_fast].save_id,
                                           allow_partial)
                except Exception as e:
                    if not damaged(e):
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
                try:
                    info = self._load_durable(dest, best_durable, all_views, allow_partial)
                except Exception as e:
                    if not lost_or_damaged(e):
                        raise
                    # A store that lost a file, bit rot: the next older complete step (the
                    # copy is left as it is); the first error if none loads.
                    first_error = first_error or e
                    skipped.append(f"durable step {best_durable} could not be loaded: "
                                   f"{type(e).__name__}: {e}")
                    warnings.warn(TierWarning(f"pyckpt: restoring {skipped[-1]}; trying the "
                                              "next source"), stacklevel=2)
                    durable_steps = [s for s in durable_steps if s != best_durable]
                    continue
                info.fast_tier_lacked = lacked if self.tier is not None else None
            break
        info.skipped[:0] = skipped
        apply()
        self._drop_newer(info.step, durable=step is not None)
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
        then releases the threads and buffers. Idempotent. (The manager's gloo groups stay for
        later managers over the same ranks; they end with the default process group.)"""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            # the lanes are shared with other managers over these ranks: wait for ours only
            mine: list[Future[Any]] = [f for f in (self._fast_future, self._persist_future)
                                       if f is not None]
            wait_futures(mine)
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
