"""What the coordinator of a :class:`pyckpt.Writer` save tells each rank (its final plan's
``storage_data``): its rank, the save's id and the byte ranges of the split items it writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["_RankPlan"]


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: its rank number, the save's id (shared by every
    rank's data files) and byte ranges of split items."""

    rank: int
    ranges: dict[MetadataIndex, tuple[int, int]]
    save_id: str = ""
    # Format version 4 (pyckpt._format_shards): every rank appends its metadata shard to its
    # data file. The coordinator's own plan carries the save's layout (grids and holders).
    shards: bool = False
    layout: Any = None
    inline: frozenset[str] = frozenset()  # of this rank's items, those stored in pyckpt.json
    # Set when a save writes with this plan (see claim); a pickled copy, as each rank
    # receives it, starts unset.
    written: list[bool] = field(default_factory=lambda: [False], compare=False, repr=False)

    def claim(self, path: str) -> None:
        """Marks the plan written by this save; raises ``ValueError`` if an earlier save wrote
        with it. DCP's plan cache (``DefaultSavePlanner(enable_plan_caching=True)``) hands a
        later save the same final plan, whose save id is the earlier save's: this save's data
        files would take its names, an overwrite of that checkpoint would replace its files in
        place, and two checkpoints would share an id."""
        if self.written[0]:
            raise ValueError(
                f"pyckpt.Writer ({path}): rank {self.rank} was handed the final plan of an "
                "earlier save again, as DCP's DefaultSavePlanner(enable_plan_caching=True) "
                "does; pyckpt.save caches plans itself (see docs/USAGE.md), or save without "
                "enable_plan_caching")
        self.written[0] = True
