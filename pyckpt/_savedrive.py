"""The save driver of :func:`pyckpt.save` and the :class:`pyckpt.CheckpointManager`: DCP's
save steps, run through the public ``SavePlanner`` / ``StorageWriter`` interfaces, with the plans
cached while the state's structure is unchanged.

``dcp.save`` gathers every rank's local plan to the coordinator and scatters the global plan
back on every save, although nothing about the layout changed since the last one. Here:

* **the first save of a structure** does the same (pickled plans over :func:`gather` and
  :func:`scatter`, each rank sending and receiving its own plan only, never the padded maximum
  of all), and every rank caches its final plan under a *generation* the coordinator draws;
* **a later save** still makes its local plan (the cheap, local part) and compares its
  structure (keys, chunk offsets and sizes, dtypes and the other tensor properties, the
  flattening map) with the cached one. One gather of a few numbers per rank (hit or miss, the
  generation, the replica check) and one broadcast of the decision (go, and the save id) then
  confirm that *every* rank still holds the structure the coordinator planned: if any rank
  differs, or a rank's cache is from another generation, every rank plans again. The key of a
  cache also holds the world size, the rank, the destination's kind (backend, shared or
  node-local, compression, metadata format) and the planner's settings, so changing any of
  them replans;
* **the replica check** (:class:`pyckpt.SavePlanner`'s ``check_replicas``) still runs on every
  save. The first plan groups the replicated items by the set of ranks holding them (DDP, FSDP
  ``NO_SHARD``: one class of all ranks; HSDP: one per replica group, plus one of all ranks for
  the plain tensors every rank holds, such as an optimizer's step); each rank sends one hash of
  its digests per class it holds items of, and the coordinator compares the hashes within each
  class. A difference makes every rank plan again, which names the item and the ranks
  (:class:`pyckpt.errors.ReplicaMismatchError`).

The write results still travel to the coordinator, which commits: in a sharded save (format
version 4, :mod:`pyckpt._format_shards`) one report of a few numbers per rank, spliced into the
layout cached with the plan; failures follow :func:`pyckpt._collective.agree`'s rule (a failing
rank raises its own exception, the others the lowest failing rank's, with a note naming it).
Loads: :mod:`pyckpt._loaddrive`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import weakref
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from pyckpt._collective import Group, attempt, portable, raise_first
from pyckpt._collective.transport import broadcast, gather, scatter

__all__ = ["save", "stats", "clear_cache"]

#: Inline bytes of the decision broadcast (a tag and a save id fit; an error goes on in a
#: second collective).
_DECISION_INLINE = 96


_Classes = tuple[tuple[int, tuple[Any, ...]], ...]
"""A rank's replica classes (:func:`_replica_classes`): (class, its items' keys) pairs."""


@dataclasses.dataclass
class _Plans:
    """One rank's cached plan of one structure."""

    structure: tuple[Any, ...]
    generation: int  # drawn by the coordinator for the plans of one structure
    central: SavePlan  # this rank's final plan from the coordinator
    metadata: Metadata  # the global metadata of the structure
    replica_classes: _Classes  # the replica classes this rank holds items of


#: Process group -> cache key -> plans. Weak: a destroyed group's plans go with it.
_by_group: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Plans]] = \
    weakref.WeakKeyDictionary()

#: Counters (for tests and benchmarks): saves planned in full, saves on cached plans.
stats = {"planned": 0, "cached": 0}


def clear_cache() -> None:
    """Forgets every cached plan of this process (the next save of each group plans again)."""
    _by_group.clear()


def _structure(plan: SavePlan) -> tuple[Any, ...]:
    """What of a local plan the global plan depends on, comparable with ``==``."""
    items = []
    for item in plan.items:
        td = item.tensor_data
        tensor = None if td is None else (tuple(td.chunk.offsets), tuple(td.chunk.sizes),
                                          td.properties, tuple(td.size))
        items.append((item.index.fqn, None if item.index.offset is None
                      else tuple(item.index.offset), item.index.index, item.type, tensor))
    return tuple(items), repr(plan.planner_data)


def _replica_hashes(plan: SavePlan, classes: _Classes) -> tuple[tuple[int, int], ...] | None:
    """This rank's hash of its digests of each replica class it holds items of, as
    ``(class, hash)`` pairs; None when the plan digested other items than the classes name."""
    digests = getattr(plan, "replica_digests", None) or {}
    if len(digests) != sum(len(keys) for _, keys in classes):
        return None
    out = []
    for cls, keys in classes:
        h = hashlib.blake2b(digest_size=8)
        for key in keys:
            if key not in digests:
                return None
            h.update(repr((key, digests[key])).encode())
        out.append((cls, int.from_bytes(h.digest(), "little") >> 1))
    return tuple(out)


def _replica_classes(plans: list[SavePlan]) -> list[_Classes]:
    """Each rank's replica classes: the replicated items its plan digested, grouped by the set
    of ranks holding them (DDP and ``NO_SHARD``: one class of all ranks; HSDP: one per replica
    group, and one of all ranks for the plain tensors every rank holds), as ``(class, keys in
    order)`` pairs."""
    holders: dict[Any, list[int]] = {}
    for rank, plan in enumerate(plans):
        for key in getattr(plan, "replica_digests", None) or {}:
            holders.setdefault(key, []).append(rank)
    numbers: dict[tuple[int, ...], int] = {}
    per_rank: list[dict[int, list[Any]]] = [{} for _ in plans]
    for key in sorted(holders, key=repr):
        ranks = tuple(holders[key])
        cls = numbers.setdefault(ranks, len(numbers))
        for rank in ranks:
            per_rank[rank].setdefault(cls, []).append(key)
    return [tuple((cls, tuple(keys)) for cls, keys in sorted(mine.items()))
            for mine in per_rank]


def save(state_dict: dict[str, Any], writer: Any, planner: SavePlanner, group: Group,
         destination: tuple[Any, ...] = (), failed: BaseException | None = None) -> Metadata:
    """Saves ``state_dict`` with ``writer`` (a :class:`pyckpt.Writer`) and ``planner`` on
    every rank of ``group``; returns the global metadata (on every rank).

    ``destination`` adds to the cache key what the writer's kind does not tell (the caller's
    settings that change the plan). ``failed``: this rank's failure before the save (its
    staging copy): every rank learns it in the first exchange and nothing is written.
    """
    coordinator = group.rank == 0

    def local_step() -> SavePlan:
        # Every failure from here on reaches every rank through the collectives below (a
        # FileExistsError of overwrite=False is the coordinator's alone, say).
        planner.set_up_planner(state_dict, storage_meta=writer.storage_meta(),
                               is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=group.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    local, error = (None, failed) if failed is not None else attempt(local_step)

    cache = None
    key: tuple[Any, ...] = ()
    if group.distributed:
        cache = _cache_of(group)
        key = (group.rank, group.world, type(planner), _planner_key(planner),
               writer.destination_key(), destination)

    central: SavePlan | None = None
    metadata: Metadata | None = None
    if cache is not None:
        central, metadata = _confirm(cache, key, local, error, group, writer)
    if central is None:
        central, metadata = _plan(cache, key, local, error, group, planner, writer)
    assert metadata is not None

    results, error = attempt(lambda: _write(writer, planner, central))
    gathered = gather((results, None if error is None else portable(error)), group,
                      what="the save's writes")
    outcome: Any = ("ok", None)
    if coordinator:
        assert gathered is not None
        failures = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
        if failures:
            outcome = ("failed", failures[:1])
        else:
            _, error = attempt(lambda: writer.finish(metadata, [res for res, _ in gathered]))
            # What the commit leaves in the metadata travels to every rank: a node-local
            # save's document, which each rank writes into its own directory as it arrives
            # (pyckpt.backends.peer.PublishedMetadata).
            outcome = (("ok", metadata.storage_data) if error is None
                       else ("failed", [(0, portable(error))]))
    outcome = broadcast(outcome, group, what="the save's commit", inline=_DECISION_INLINE)
    if outcome[0] == "failed":
        writer.end_failed_save()  # every rank's writes are done: its directory may go
        raise_first(dict(outcome[1]), error, "the save")
    # A copy: the cached metadata serves the next save of this structure too.
    return dataclasses.replace(metadata, storage_data=outcome[1])


def _cache_of(group: Group) -> dict[tuple[Any, ...], _Plans]:
    """The plans cached for ``group`` (a function of its own, so that no frame of a save that
    fails, kept alive by its exception, holds the default group)."""
    import torch.distributed as dist

    return _by_group.setdefault(group.pg if group.pg is not None else dist.group.WORLD, {})


def _planner_key(planner: Any) -> tuple[Any, ...]:
    return tuple(getattr(planner, name, None) for name in (
        "flatten_state_dict", "flatten_sharded_tensors", "split_alignment", "check_replicas",
        "dedup_save_to_lowest_rank"))


def _write(writer: Any, planner: SavePlanner, central: SavePlan) -> Any:
    final = planner.finish_plan(central)
    fut = writer.write_data(final, planner)
    fut.wait()
    return fut.value()


def _confirm(cache: dict[tuple[Any, ...], _Plans], key: tuple[Any, ...],
             local: SavePlan | None, error: BaseException | None, group: Group,
             writer: Any) -> tuple[SavePlan | None, Metadata | None]:
    """The steady state: every rank confirms that its cached plan still holds (one gather of a
    few numbers, one small broadcast). Returns this rank's cached plan renewed for this save,
    or (None, None) when every rank must plan again."""
    cached = cache.get(key)
    hit = (error is None and local is not None and cached is not None
           and cached.structure == _structure(local))
    probe: tuple[Any, ...] = (False, 0, ())
    if hit:
        assert cached is not None and local is not None
        rhashes = _replica_hashes(local, cached.replica_classes)
        if rhashes is not None:
            probe = (True, cached.generation, rhashes)
    probes = gather(probe, group, what="the save's plan check")
    decision: Any = None
    if group.rank == 0:
        assert probes is not None
        generations = {p[1] for p in probes}
        agreed = all(p[0] for p in probes) and len(generations) == 1
        hashes: dict[int, set[int]] = {}
        for _, _, pairs in probes:
            for cls, h in pairs:
                hashes.setdefault(cls, set()).add(h)
        if agreed and all(len(hs) == 1 for hs in hashes.values()):
            decision = ("go", writer.save_id)
    decision = broadcast(decision, group, what="the save's plan check", inline=_DECISION_INLINE)
    if decision is None:
        return None, None
    assert cached is not None
    stats["cached"] += 1
    return writer.renew_plan(cached.central, decision[1]), cached.metadata


def _plan(cache: dict[tuple[Any, ...], _Plans] | None, key: tuple[Any, ...],
          local: SavePlan | None, error: BaseException | None, group: Group,
          planner: SavePlanner, writer: Any) -> tuple[SavePlan, Metadata]:
    """The full plan: local plans to the coordinator, each rank's final plan back."""
    stats["planned"] += 1
    if cache is not None:
        cache.pop(key, None)  # never a stale plan, whatever happens below
    plans = gather((local, None if error is None else portable(error)), group,
                   what="the save's planning")
    replies: list[Any] | None = None
    metadata: Metadata | None = None
    own: BaseException | None = None  # the coordinator's failure of the global step
    if group.rank == 0:
        assert plans is not None
        failed = [(r, e) for r, (_, e) in enumerate(plans) if e is not None]
        if failed:
            replies = [("failed", failed[:1])] * group.world
        else:
            local_plans = [p for p, _ in plans]

            def global_step() -> tuple[list[SavePlan], Metadata]:
                all_plans, md = planner.create_global_plan(local_plans)
                final = writer.prepare_global_plan(all_plans)
                # what every rank gets back: for a sharded save, each tensor's pieces as its
                # grid (O(tensors), not a chunk per rank and tensor)
                return final, writer.compact_metadata(md, final)

            out, own = attempt(global_step)
            if own is not None:
                replies = [("failed", [(0, portable(own))])] * group.world
            else:
                assert out is not None
                all_plans, metadata = out
                classes = _replica_classes(local_plans)
                generation = random.getrandbits(62) + 1
                replies = [("plan", p, generation, c) for p, c in zip(all_plans, classes)]
    reply = scatter(replies, group, what="the save's planning")
    if reply[0] == "failed":
        raise_first(dict(reply[1]), error if error is not None else own, "the save's planning")
    _, central, generation, replica_classes = reply
    # Every rank returns the metadata, as dcp.save does (the first save of a structure only:
    # later ones return the cached copy).
    metadata = broadcast(metadata, group, what="the save's metadata", inline=_DECISION_INLINE)
    assert local is not None and metadata is not None
    if cache is not None:
        cache[key] = _Plans(_structure(local), generation, central, metadata, replica_classes)
    return central, metadata


