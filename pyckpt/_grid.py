"""A tensor's stored pieces as a grid, and where the pieces of a global save plan lie.

Sharded state is nearly always a grid: FSDP splits dimension 0 over the ranks, tensor
parallelism splits one more dimension, replicated state is one cell. A :class:`Grid` holds,
per dimension, the runs of equal cells (an even split over N ranks is one run, whatever N), so
a tensor's pieces take O(runs) to describe and every query is a bisection.
:meth:`Grid.of` finds the grid of a set of boxes, which also proves that they tile the tensor
exactly (no hole, no overlap).

:class:`Pieces` is a global save plan seen per tensor: its grid, and the ranks writing each
cell. :class:`pyckpt.SavePlanner` makes it while it balances (it validates the plan with the
grids) and hands it to the storage writer with rank 0's plan (``ByteRanges.pieces``);
:meth:`Pieces.of_plans` finds it in the final plans of any planner. Format version 4
(:mod:`pyckpt._format_shards`) describes a save with it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Axis", "Grid", "Pieces"]


def _runs(values: Sequence[int]) -> list[list[int]]:
    """``[[value, count], ...]``: ``values`` run-length encoded."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


@dataclass(frozen=True, slots=True)
class Axis:
    """The cells of a grid along one dimension, as runs of equal cells: an even split over N
    ranks is one run, whatever N, and every query is a bisection over the runs."""

    runs: tuple[tuple[int, int], ...]  # (cell size, count)
    first: tuple[int, ...]  # number of the first cell of each run
    start: tuple[int, ...]  # offset of the first cell of each run
    n: int  # cells
    length: int  # the dimension's size

    @classmethod
    def of_runs(cls, runs: Sequence[Sequence[int]]) -> Axis:
        first, start, n, pos = [], [], 0, 0
        for size, count in runs:
            first.append(n)
            start.append(pos)
            n += count
            pos += size * count
        return cls(tuple((int(r[0]), int(r[1])) for r in runs), tuple(first), tuple(start), n,
                   pos)

    def _run(self, i: int) -> int:
        return bisect.bisect_right(self.first, i) - 1

    def offset(self, i: int) -> int:
        k = self._run(i)
        return self.start[k] + (i - self.first[k]) * self.runs[k][0]

    def size(self, i: int) -> int:
        return self.runs[self._run(i)][0]

    def index_at(self, o: int) -> int | None:
        """The cell starting at offset ``o``, None when none does."""
        k = bisect.bisect_right(self.start, o) - 1
        if k < 0:
            return None
        size, count = self.runs[k]
        rel = o - self.start[k]
        if size == 0:
            return self.first[k] if rel == 0 else None
        q, r = divmod(rel, size)
        return self.first[k] + q if r == 0 and q < count else None

    def starting_before(self, x: int) -> int:
        """How many cells start before ``x``."""
        k = bisect.bisect_left(self.start, x) - 1
        if k < 0:
            return 0
        size, count = self.runs[k]
        return self.first[k] + (count if size == 0 else min(count, -(-(x - self.start[k]) // size)))

    def ending_by(self, x: int) -> int:
        """How many cells end at or before ``x``."""
        k = bisect.bisect_right(self.start, x) - 1
        if k < 0:
            return 0
        size, count = self.runs[k]
        return self.first[k] + (count if size == 0 else min(count, (x - self.start[k]) // size))


@dataclass(frozen=True, slots=True)
class Grid:
    """A tensor's pieces as a grid: along each dimension, its cells (:class:`Axis`). Cells
    are numbered in row-major order; a cell is one stored piece (DCP's chunk of that
    ``MetadataIndex.index``)."""

    shape: tuple[int, ...]
    axes: tuple[Axis, ...]

    @classmethod
    def from_bounds(cls, shape: Sequence[int], bounds: Sequence[Sequence[int]]) -> Grid:
        """The grid whose cells along dimension ``d`` end at ``bounds[d][1:]`` (``bounds[d]``:
        0, then each cell's end)."""
        return cls(tuple(shape), tuple(
            Axis.of_runs(_runs([b[i + 1] - b[i] for i in range(len(b) - 1)])) for b in bounds))

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(a.n for a in self.axes)

    @property
    def ncells(self) -> int:
        return math.prod(self.counts)

    @property
    def nonempty(self) -> int:
        """Cells with at least one element."""
        return math.prod(sum(count for size, count in a.runs if size) for a in self.axes)

    def coords(self, cell: int) -> tuple[int, ...]:
        out = []
        for a in reversed(self.axes):
            cell, c = divmod(cell, a.n)
            out.append(c)
        return tuple(reversed(out))

    def cell(self, cell: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of cell number ``cell``."""
        cs = self.coords(cell)
        return (tuple(a.offset(c) for a, c in zip(self.axes, cs)),
                tuple(a.size(c) for a, c in zip(self.axes, cs)))

    def number(self, offsets: Sequence[int]) -> int | None:
        """The number of the cell that starts at ``offsets``, None when none does."""
        if len(offsets) != len(self.axes):
            return None
        n = 0
        for a, o in zip(self.axes, offsets):
            i = a.index_at(o)
            if i is None:
                return None
            n = n * a.n + i
        return n

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[int]:
        """Numbers of the cells overlapping the box, in row-major order, by DCP's rule (along
        every dimension each starts before the other ends: an empty box overlaps the cell it
        lies strictly inside of)."""
        ranges = []
        for a, o, s in zip(self.axes, offsets, sizes):
            first, last = a.ending_by(o), a.starting_before(o + s)
            if first >= last:
                return
            ranges.append(range(first, last))
        counts = self.counts

        def walk(d: int, base: int) -> Iterator[int]:
            if d == len(ranges):
                yield base
                return
            for c in ranges[d]:
                yield from walk(d + 1, base * counts[d] + c)

        yield from walk(0, 0)

    def runs(self) -> list[list[list[int]]]:
        return [[list(r) for r in a.runs] for a in self.axes]

    @classmethod
    def of(cls, shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
           ) -> tuple[Grid, list[int]] | None:
        """The grid whose cells are exactly ``boxes`` ((offsets, sizes) each) and each box's
        cell number; None when they are not one (overlaps, holes, or not a product of
        per-dimension splits)."""
        return cls.of_boxes(shape, [o for o, _ in boxes], [s for _, s in boxes])

    @classmethod
    def of_boxes(cls, shape: Sequence[int], offsets: Sequence[Sequence[int]],
                 sizes: Sequence[Sequence[int]]) -> tuple[Grid, list[int]] | None:
        """:meth:`of`, the boxes given as their offsets and their sizes. Every step is a loop
        in C over a column (one dimension of every box): at thousands of ranks the boxes are
        scattered over the coordinator's memory, and each pass in Python over them costs."""
        shape = tuple(int(n) for n in shape)
        ndim, count = len(shape), len(offsets)
        if count == 0 or len(sizes) != count or set(map(len, offsets)) != {ndim} or \
                set(map(len, sizes)) != {ndim}:
            return None
        numbers: list[int] = [0] * count
        bounds = []
        for n, column, extent in zip(shape, zip(*offsets), zip(*sizes)):
            starts = sorted(set(column))
            if starts[0] != 0 or (n > 0 and starts[-1] >= n):
                return None
            b = (*starts, n) if n > 0 else (0, 0)
            at = {b[i]: i for i in range(len(b) - 1)}
            cell_size = {b[i]: b[i + 1] - b[i] for i in range(len(b) - 1)}
            try:
                if list(map(cell_size.__getitem__, column)) != list(extent):
                    return None
                ids = map(at.__getitem__, column)
                numbers = list(map(int.__add__, map((len(b) - 1).__mul__, numbers), ids))
            except (KeyError, TypeError):  # an offset between two cells' starts; not an int
                return None
            bounds.append(b)
        grid = cls.from_bounds(shape, bounds)
        if grid.ncells != count or len(set(numbers)) != count:
            return None
        return grid, numbers


@dataclass
class Pieces:
    """Where the pieces of a global save plan lie: each tensor's properties, grid and the
    ranks writing each cell (in the order of the bytes they write: a replicated tensor split
    by bytes has several), and the ranks writing each bytes item."""

    tensors: dict[str, tuple[Any, Grid, list[list[int]]]]
    bytes_items: dict[str, list[int]]
    writes: int  # items over all the plans described (what a consumer checks them against)

    def describes(self, plans: Sequence[Any]) -> bool:
        """Whether these could be the pieces of ``plans`` (as many writes: a cheap guard
        against plans changed after the planner made them)."""
        return sum(len(p.items) for p in plans) == self.writes

    @classmethod
    def of_plans(cls, plans: Sequence[Any]) -> Pieces | None:
        """The pieces of DCP's final save plans (each ``storage_data`` may hold the byte
        ranges of split items, ``.ranges``), or None when some tensor's pieces are not a
        grid."""
        from torch.distributed.checkpoint.planner import WriteItemType

        boxes: dict[str, dict[tuple[int, ...], list[tuple[int, int]]]] = {}
        props: dict[str, Any] = {}
        byte_holders: dict[str, list[tuple[int, int]]] = {}
        writes = 0
        for rank, plan in enumerate(plans):
            ranges = getattr(plan.storage_data, "ranges", None) or {}
            writes += len(plan.items)
            for item in plan.items:
                start = ranges.get(item.index, (0, 0))[0] if ranges else 0
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    byte_holders.setdefault(fqn, []).append((start, rank))
                    continue
                td = item.tensor_data
                key = tuple(td.chunk.offsets)
                entry = boxes.setdefault(fqn, {})
                if key not in entry:
                    entry[key] = []
                    props.setdefault(fqn, (td.properties, tuple(td.size), {}))[2][key] = tuple(
                        td.chunk.sizes)
                entry[key].append((start, rank))
        tensors = {}
        for fqn, cells in boxes.items():
            properties, shape, sizes = props[fqn]
            found = Grid.of(shape, [(o, sizes[o]) for o in cells])
            if found is None:
                return None
            grid, numbers = found
            per_cell: list[list[int]] = [[] for _ in range(grid.ncells)]
            for n, holders in zip(numbers, cells.values()):
                per_cell[n] = [r for _, r in holders] if len(holders) == 1 else [
                    r for _, r in sorted(holders)]
            tensors[fqn] = (properties, grid, per_cell)
        bytes_items = {fqn: [r for _, r in sorted(h)] for fqn, h in byte_holders.items()}
        return cls(tensors, bytes_items, writes)
