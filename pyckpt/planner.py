"""DCP save planner that spreads replicated state over every rank that holds it.

DCP's :class:`~torch.distributed.checkpoint.default_planner.DefaultSavePlanner` deduplicates
replicated items: each item held by several ranks is written whole by one of them, chosen
greedily in arrival order. Two ranks saving one replicated 100 MiB tensor then write 100 MiB and
0 B, and an FSDP ``NO_SHARD`` or DDP checkpoint is written by essentially one rank.

:class:`SavePlanner` keeps every copy in the local plans and lets the coordinator decide, by
bytes, which rank writes which part of each replicated item:

* an item present in exactly one rank's plan (a DTensor shard, a ``ShardedTensor`` shard) stays
  with that rank and counts toward its load;
* items present in several plans (plain tensors under DDP / FSDP ``NO_SHARD``, DTensors with
  ``Replicate()`` placements, the replicated mesh dimension of HSDP) are grouped by the set of
  ranks that hold them; each group's bytes are water-filled over its holders on top of the load
  they already carry, and the group's items, largest first, are cut into consecutive segments,
  one per holder, at multiples of :data:`SPLIT_ALIGNMENT` bytes;
* non-tensor values (``BYTE_IO`` items) are never split and are written once.

With a compressing :class:`pyckpt.Writer` the loads are estimated stored bytes, not raw bytes:
the writer names its encoding in the ``StorageMeta`` DCP passes to ``set_up_planner``, each
rank estimates its tensor items' stored sizes from samples of at most 64 KiB encoded with the
same codec (:func:`pyckpt._stored_size.stored_sizes`), and the coordinator balances those.

Before any of that, the planner checks that the copies of replicated tensors agree: each rank
digests every tensor it holds that other ranks may hold too (:func:`replica_digests`, in the local
plan step), and the coordinator compares the digests of each item's holders. Copies that differ
(desynchronised DDP replicas, say) would otherwise be saved as a silent mix of the ranks' bytes;
instead every rank raises :class:`pyckpt.errors.ReplicaMismatchError` before anything is
written. By default the digest reads a sample of at most 1 MiB per tensor (the same blocks on
every rank); ``SavePlanner(check_replicas="full")`` reads every byte, and
``SavePlanner(check_replicas=False)`` skips the check.

The outcome reaches the storage layer in ``SavePlan.storage_data`` as a :class:`ByteRanges`:
for every item a rank writes only partially, the half-open byte range of the item's row-major
contiguous bytes that this rank writes. The ranges of the copies of one item tile
``[0, nbytes)`` exactly. :class:`pyckpt.Writer` writes only those bytes and records the
segments in the checkpoint metadata; :class:`pyckpt.Reader` reassembles them for any load world
size. The planner therefore requires :class:`pyckpt.Writer`; DCP's own writers would ignore
the ranges and write every copy whole.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import ChainMap
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from pyckpt import _gc
from pyckpt._balance import (
    SPLIT_ALIGNMENT,
    ByteRanges,
    _balance,
    _build_metadata,
    _validate,
    balance_save_plans,
    plan_digest,
)
from pyckpt._options import canonical
from pyckpt._replicas import (
    CheckMode,
    Digest,
    _CheckedPlan,
    _ItemKey,
    _key,
    _may_be_replicated,
    check_replica_digests,
    replica_digests,
)
from pyckpt._stored_size import Encoding, WriterMeta, stored_sizes

__all__ = [
    "SPLIT_ALIGNMENT",
    "ByteRanges",
    "SavePlanner",
    "balance_save_plans",
    "check_replica_digests",
    "replica_digests",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _LocalPlan(_CheckedPlan):
    """A local plan of :class:`SavePlanner`: the replica digests, and, when the writer
    compresses, each tensor item's estimated stored size (what the coordinator balances; see
    :func:`pyckpt._stored_size.stored_sizes`). ``dataclasses.replace`` keeps both."""

    stored_sizes: dict[_ItemKey, int] = dataclasses.field(default_factory=dict)
    digest: bytes = b""
    """:func:`pyckpt._balance.plan_digest` of the items and replica digests: the coordinator
    collects plans with equal digests once."""


class SavePlanner(DefaultSavePlanner):
    """DCP save planner that balances the bytes each rank writes, splitting replicated items.

    Usage::

        dcp.save(state_dict, storage_writer=pyckpt.Writer(path), planner=pyckpt.SavePlanner())

    Local planning is DCP's (every rank lists every item it holds, flattened like DCP does);
    global planning replaces DCP's whole-item deduplication with :func:`balance_save_plans`.
    The metadata names each item once, and every rank writing part of it holds the same copy
    (no index hints: no writer uses them). Plan caching (``enable_plan_caching``) is not
    supported: :func:`pyckpt.save` caches plans itself.

    Requires :class:`pyckpt.Writer`, which writes only each rank's byte ranges. With DCP's
    default planner, :class:`pyckpt.Writer` still works, but each replicated item is then
    written whole by one rank.

    Thread safety: one instance per save; not safe to share between concurrent saves.

    Args:
        flatten_state_dict: Flatten nested dicts and lists, as DCP's default planner does.
        flatten_sharded_tensors: Flatten nested ``ShardedTensor``\\ s (FSDP 2D), as DCP does.
        split_alignment: Interior split points lie at multiples of this many bytes (a positive
            multiple of 16; default :data:`SPLIT_ALIGNMENT`, 1 MiB).
        check_replicas: Before planning, check that the copies of replicated state agree and
            raise :class:`pyckpt.errors.ReplicaMismatchError` (on every rank, before anything
            is written) if not. ``True`` or ``"sample"`` (the default): each rank reads the
            same sample of at most 1 MiB per tensor (tensors up to 1 MiB whole), which finds
            copies that differ nearly everywhere (desynchronised DDP) but can miss a difference
            confined to bytes outside the sample (see docs/REPLICATED.md). ``"full"``: each rank
            reads every replicated byte it holds (on its device for large GPU tensors).
            ``False``: no check. Skipped in a single process.

    Raises:
        ValueError: ``split_alignment`` is not a positive multiple of 16, or ``check_replicas``
            is not one of ``True``, ``False``, ``"sample"``, ``"full"``.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        *,
        split_alignment: int = SPLIT_ALIGNMENT,
        check_replicas: bool | CheckMode = True,
    ) -> None:
        if split_alignment <= 0 or split_alignment % 16:
            raise ValueError(
                f"split_alignment must be a positive multiple of 16, got {split_alignment}"
            )
        mode: Literal[False] | CheckMode
        if isinstance(check_replicas, str):  # any case
            check_replicas = cast(
                CheckMode, canonical(check_replicas, ("sample", "full")) or check_replicas)
        if check_replicas is True or check_replicas == "sample":
            mode = "sample"
        elif check_replicas is False or check_replicas == "full":
            mode = check_replicas
        else:
            raise ValueError(
                f"check_replicas must be True, False, 'sample' or 'full' (any case), got "
                f"{check_replicas!r}"
            )
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
        )
        self.split_alignment = split_alignment
        self.check_replicas = mode  # "sample", "full" or False
        self.encoding: Encoding | None = None  # the writer's, from set_up_planner

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, plus the digests of the items other ranks may also hold.

        Returns:
            The local plan; with ``check_replicas`` in a process group of several ranks, a plan
            that also carries the content digest of every item that may be replicated (see
            :func:`replica_digests`).
        """
        with _gc.paused():  # a write item per tensor and shard, all kept (see pyckpt._gc)
            return self._create_local_plan()

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's set-up; also takes the writer's encoding from ``storage_meta`` (a
        :class:`pyckpt.Writer` names it there), so that a compressing writer's replicated items
        are balanced by estimated stored bytes.

        Raises:
            ValueError: ``storage_meta`` is another writer's (DCP's ``FileSystemWriter``...):
                such a writer would not write the byte ranges of split items.
        """
        if storage_meta is not None and not isinstance(storage_meta, WriterMeta):
            raise ValueError(
                f"pyckpt.SavePlanner needs pyckpt.Writer, which writes only each rank's byte "
                f"ranges of a replicated item split over the ranks; the writer of this save "
                f"(checkpoint {str(storage_meta.checkpoint_id)!r}) is another one: save with "
                f"pyckpt.Writer, or with DCP's DefaultSavePlanner for this writer"
            )
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        encoding = getattr(storage_meta, "encoding", None)
        self.encoding = encoding if isinstance(encoding, Encoding) else None

    def _create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        encoding = self.encoding
        estimate = encoding is not None and encoding.compresses
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return plan
        replicable: list[tuple[_ItemKey, torch.Tensor]] = []
        others: list[tuple[_ItemKey, torch.Tensor]] = []
        for item in plan.items if self.check_replicas or estimate else ():
            if item.type == WriteItemType.BYTE_IO:
                continue
            may_be_replicated = _may_be_replicated(self.state_dict.get(item.index.fqn), item)
            if not (may_be_replicated or estimate):
                continue
            data = self.lookup_object(item.index)
            # Layouts the writer refuses are left to its typed error.
            if (
                isinstance(data, torch.Tensor)
                and data.layout == torch.strided
                and not (data.is_quantized or data.is_meta)
            ):
                (replicable if may_be_replicated else others).append((_key(item.index), data))
        digests: dict[_ItemKey, Digest] = {}
        if self.check_replicas:
            start = time.perf_counter()
            keys = [k for k, _ in replicable]
            digests = dict(
                zip(keys, replica_digests([t for _, t in replicable], mode=self.check_replicas))
            )
            logger.debug(
                "replica check (%s): %d tensors digested in %.3f s",
                self.check_replicas,
                len(replicable),
                time.perf_counter() - start,
            )
        sizes: dict[_ItemKey, int] = {}
        if encoding is not None and estimate and replicable:
            # The coordinator balances replicated items against what each holder already
            # writes, so every tensor item of this rank is estimated, in the same unit.
            start = time.perf_counter()
            estimated = replicable + others
            estimates = stored_sizes([t for _, t in estimated], encoding)
            sizes = {k: v for (k, _), v in zip(estimated, estimates)}
            logger.debug(
                "stored sizes: %d tensors estimated in %.3f s",
                len(estimated),
                time.perf_counter() - start,
            )
        plan = _LocalPlan(
            items=plan.items,
            storage_data=plan.storage_data,
            planner_data=plan.planner_data,
            usable=plan.usable,
            replica_digests=digests,
            stored_sizes=sizes,
            digest=plan_digest(plan.items, digests),
        )
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Balance the local plans and build the checkpoint metadata.

        Args:
            all_plans: Local plans, one per rank.

        Returns:
            The per-rank plans (items to write, ``storage_data`` a :class:`ByteRanges`) and the
            global ``Metadata``.

        Raises:
            ReplicaMismatchError: With ``check_replicas``, if copies of a replicated item differ
                (see :func:`check_replica_digests`).
            ValueError: If the plans are inconsistent (see :func:`balance_save_plans`) or the
                shards of a tensor do not cover it exactly.
        """
        with _gc.paused():  # O(N x T) objects that all stay alive (see pyckpt._gc)
            return self._create_global_plan(all_plans)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.check_replicas:
            check_replica_digests(all_plans)
        per_rank = _balance(all_plans, self.split_alignment)
        finals, metadata, pieces = _build_metadata(per_rank)
        global_plan = [  # plain SavePlans: the digests need not travel back
            SavePlan(items=items, storage_data=ByteRanges(ranges, pieces if rank == 0 else None),
                     planner_data=plan.planner_data, usable=plan.usable)
            for rank, (plan, (items, ranges)) in enumerate(zip(all_plans, finals))
        ]

        if self.flatten_state_dict:
            merged = dict(ChainMap(*(p.planner_data for p in all_plans if p.planner_data)))
            metadata = dataclasses.replace(metadata, planner_data=merged)

        errors = _validate(metadata, len(all_plans), pieces)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"invalid global save plan: {summary}")

        self.global_plan = global_plan
        self.metadata = metadata
        return global_plan, metadata
