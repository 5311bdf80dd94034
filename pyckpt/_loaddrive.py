"""The load driver of :func:`pyckpt.load` (and so of the manager's restores through it): DCP's
load steps, run through the public ``LoadPlanner`` / ``StorageReader`` interfaces, with the
global plan cached while nothing it depends on changed.

``dcp.load`` gathers every rank's local plan (every read item) to the coordinator and scatters
the global plan back on every load. Here, as :mod:`pyckpt._savedrive` does for saves:

* **the first load** of a (checkpoint layout, local plan) does the same (each rank sends and
  receives its own plan only), and every rank caches its final plan under a *generation* the
  coordinator draws, when that plan carries nothing tied to one checkpoint (a cooperative
  load's chunk assignment names data files of one save: never cached);
* **a later load** still reads the metadata and makes its local plan (the local part; for a
  sharded checkpoint it reads only the shards it needs) and compares the plan's read items and
  the checkpoint's layout (each stored tensor's dtype, shape and pieces, the stored keys) with
  the cached ones. One gather of a few numbers per rank (hit or miss, the generation, a digest
  of the checkpoint's save id) and one broadcast of the decision confirm that every rank still
  holds what the coordinator planned, and loads the same checkpoint; otherwise every rank plans
  again.

Any failure of the local step (no ``pyckpt.json``: a rank-local checkpoint, or none at all)
hands the whole load to ``dcp.load`` on every rank, which falls back to rank-local metadata or
raises the typed error as it always did; a lost rank (:class:`~pyckpt.errors.PeerLostError`)
is raised at once instead. A failure while reading is raised on every rank (the
failing rank's own exception, the lowest failing rank's on the others).
"""

from __future__ import annotations

import hashlib
import random
import weakref
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from pyckpt._collective import Group, attempt, is_peer_failure, portable, raise_first
from pyckpt._collective.transport import broadcast, gather, scatter

__all__ = ["load", "run", "stats", "clear_cache"]

_DECISION_INLINE = 96


@dataclass
class _Plans:
    items: list[Any]  # the local plan's read items
    planner_data: Any  # the local plan's (pyckpt.LoadPlanner: the state dict's top-level keys)
    layout: bytes  # digest of the checkpoint's layout
    generation: int
    central: LoadPlan  # this rank's final plan from the coordinator


_by_group: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Plans]] = \
    weakref.WeakKeyDictionary()

#: Counters (for tests and benchmarks): loads planned in full, loads on cached plans, loads
#: handed to dcp.load.
stats = {"planned": 0, "cached": 0, "dcp": 0}


def clear_cache() -> None:
    _by_group.clear()


def layout_digest(metadata: Metadata) -> bytes:
    """A digest of what a load plan depends on in a checkpoint: its keys, and each tensor's
    dtype, shape and stored pieces (for a sharded checkpoint, its grids: O(tensors))."""
    h = hashlib.blake2b(digest_size=16)
    for fqn in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            h.update(repr((fqn, "bytes")).encode())
            continue
        grid = getattr(md.chunks, "grid", None)  # pyckpt._loadplan.GridChunks
        pieces = grid.runs() if grid is not None else tuple(
            (tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        h.update(repr((fqn, str(md.properties.dtype), tuple(md.size), pieces)).encode())
    return h.digest()


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(),
                          "little") >> 1


def load(state_dict: dict[str, Any], reader: Any, planner: LoadPlanner, group: Group,
         key: tuple[Any, ...] = ()) -> bool:
    """Loads ``state_dict`` with ``reader`` (a :class:`pyckpt.Reader`) and ``planner`` on
    every rank of ``group`` (distributed) as ``dcp.load`` does (``Stateful`` values through
    their ``state_dict`` / ``load_state_dict``); returns False, on every rank, when the caller
    must run ``dcp.load`` instead (see the module docstring). ``key`` adds the caller's
    settings to the cache key."""
    from torch.distributed.checkpoint.stateful import Stateful

    keys = sorted(state_dict)
    flat = {k: state_dict[k].state_dict() if isinstance(state_dict[k], Stateful)
            else state_dict[k] for k in keys}
    if not _load(flat, reader, planner, group, key):
        return False
    for k in keys:
        if isinstance(state_dict[k], Stateful):
            state_dict[k].load_state_dict(flat[k])
        else:
            state_dict[k] = flat[k]
    return True


def run(state_dict: dict[str, Any], reader: Any, planner: LoadPlanner, group: Group,
        key: tuple[Any, ...] = ()) -> None:
    """Loads ``state_dict`` on every rank of ``group``: through :func:`load` when the group is
    distributed, else (or when :func:`load` hands over) with ``dcp.load``."""
    if group.distributed and load(state_dict, reader, planner, group, key):
        return
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group.pg)


def _cache_of(group: Group) -> dict[tuple[Any, ...], _Plans]:
    import torch.distributed as dist

    return _by_group.setdefault(group.pg if group.pg is not None else dist.group.WORLD, {})


def _load(state_dict: dict[str, Any], reader: Any, planner: LoadPlanner, group: Group,
          key: tuple[Any, ...]) -> bool:
    coordinator = group.rank == 0
    metadata: Metadata | None = None

    def local_step() -> LoadPlan:
        nonlocal metadata
        metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, coordinator)
        reader.set_up_storage_reader(metadata, coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    local, error = attempt(local_step)
    if error is not None and is_peer_failure(error):
        raise error  # a lost rank: no more collectives (nor dcp.load's) on this group
    layout = b"" if metadata is None or error is not None else layout_digest(metadata)
    cache = _cache_of(group)
    ckey = (group.rank, group.world, type(planner), getattr(planner, "allow_partial_load", None),
            getattr(reader, "cooperative", None), getattr(reader, "allow_partial", None), key)
    cached = cache.get(ckey)
    hit = (error is None and local is not None and cached is not None
           and cached.layout == layout and cached.items == local.items
           and cached.planner_data == local.planner_data)
    node = getattr(local, "storage_data", None)  # pyckpt._coop.LoadNode: this checkpoint
    # the save id names the checkpoint (a node-local one has another path on every node)
    probe = (error is None, hit, cached.generation if hit and cached else 0,
             _digest(getattr(node, "save_id", None)))
    probes = gather(probe, group, what="the load's plan check")
    decision: Any = None
    if coordinator:
        assert probes is not None
        if not all(p[0] for p in probes):
            decision = "dcp"
        elif all(p[1] for p in probes) and len({(p[2], p[3]) for p in probes}) == 1:
            decision = "go"
    decision = broadcast(decision, group, what="the load's plan check", inline=_DECISION_INLINE)
    if decision == "dcp":
        stats["dcp"] += 1
        return False
    assert local is not None
    if decision == "go":
        assert cached is not None
        stats["cached"] += 1
        central = cached.central
    else:
        stats["planned"] += 1
        cache.pop(ckey, None)  # never a stale plan, whatever happens below
        central, generation = _plan(local, planner, reader, group)
        if generation:
            cache[ckey] = _Plans(list(local.items), local.planner_data, layout, generation,
                                 central)
    _, error = attempt(lambda: reader.read_data(planner.finish_plan(central), planner).wait())
    outcomes = gather(None if error is None else portable(error), group,
                      what="the load's reads")
    failed: Any = None
    if coordinator:
        assert outcomes is not None
        failed = [(r, e) for r, e in enumerate(outcomes) if e is not None][:1] or None
    failed = broadcast(failed, group, what="the load's reads", inline=_DECISION_INLINE)
    if failed:
        raise_first(dict(failed), error, "the load")
    return True


def _plan(local: LoadPlan, planner: LoadPlanner, reader: Any, group: Group
          ) -> tuple[LoadPlan, int]:
    """The full plan: local plans to the coordinator, each rank's final plan back, with the
    generation to cache it under (0: not cacheable)."""
    plans = gather(local, group, what="the load's planning")
    replies: list[Any] | None = None
    own: BaseException | None = None
    if group.rank == 0:
        assert plans is not None

        def global_step() -> list[LoadPlan]:
            return list(reader.prepare_global_plan(planner.create_global_plan(plans)))

        out, own = attempt(global_step)
        if own is not None:
            replies = [("failed", [(0, portable(own))])] * group.world
        else:
            assert out is not None
            cacheable = all(p.storage_data is None for p in out)
            generation = random.getrandbits(62) + 1 if cacheable else 0
            replies = [("plan", p, generation) for p in out]
    reply = scatter(replies, group, what="the load's planning")
    if reply[0] == "failed":
        raise_first(dict(reply[1]), own, "the load's planning")
    return reply[1], reply[2]
