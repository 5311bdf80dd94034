"""Per-tensor index of stored chunks, for load planning that does not grow with their number.

A sharded checkpoint stores one piece (DCP chunk: a hyper-rectangle of the tensor) per tensor and
saving rank. DCP's ``create_read_items_for_chunk_list`` sorts a tensor's N stored chunks every
time a rank plans a load: O(N log N) per tensor and rank, O(T x N log N) for a rank loading T
tensors, although each rank reads only the few pieces its own shard overlaps.

:class:`ChunkIndex` is built once per tensor when the metadata is read (the reader parses every
piece anyway): the pieces sorted by their start along one *sweep dimension*, and the running
maximum of their ends along it. A wanted box then finds its overlapping pieces with two bisects
and a scan of the candidates between them: O(log N + k), k being the pieces that overlap the
box along the sweep dimension (the pieces it overlaps, for pieces cut along that dimension).

Writers emit pieces in this order (:func:`sweep_order`), so building the index is a linear pass;
the index never relies on it (an older or hand-edited document in any order is sorted here).

No torch here: chunks are any objects with ``offsets`` and ``sizes`` sequences (DCP's
``ChunkStorageMetadata``, pyckpt's ``StoredPiece``).
"""

from __future__ import annotations

import operator
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate, islice
from typing import Any, Protocol

__all__ = ["ChunkIndex", "sweep_dim", "sweep_order"]


class _Box(Protocol):
    @property
    def offsets(self) -> Sequence[int]: ...

    @property
    def sizes(self) -> Sequence[int]: ...


def sweep_dim(shape: Sequence[int], chunks: Sequence[_Box]) -> int:
    """The dimension the chunks of a tensor of ``shape`` are indexed along (-1 for a 0-d
    tensor): the one along which their starts take the most distinct values (ties: the larger
    extent, then the lower dimension).

    DCP sweeps along the dimension of largest extent. That is blind to how the tensor was cut:
    an FSDP-sharded ``[4096, 16384]`` weight is cut along dim 0 only, and sweeping along dim 1
    makes every piece a candidate of every query. Distinct starts count the cuts.
    """
    ndim = len(shape)
    if ndim == 0:
        return -1
    if len(chunks) <= 1 or ndim == 1:
        return max(range(ndim), key=lambda d: (shape[d], -d))
    best, best_key = 0, (-1, -1)
    for d in range(ndim):
        key = (len({c.offsets[d] for c in chunks}), shape[d])
        if key > best_key:
            best, best_key = d, key
    return best


def sweep_order(shape: Sequence[int], chunks: Sequence[Any]) -> Sequence[Any]:
    """``chunks`` in the order :class:`ChunkIndex` indexes them (stable, by start along
    :func:`sweep_dim`); ``chunks`` itself when already in that order. For writers: a document
    whose pieces come in this order is indexed without a sort."""
    d = sweep_dim(shape, chunks)
    if d < 0 or len(chunks) <= 1:
        return chunks
    starts = [c.offsets[d] for c in chunks]
    if all(map(operator.le, starts, islice(starts, 1, None))):
        return chunks
    return [chunks[i] for i in sorted(range(len(chunks)), key=starts.__getitem__)]


class ChunkIndex:
    """The stored chunks of one tensor, indexed for overlap queries.

    Args:
        shape: the tensor's full shape.
        chunks: its stored chunks (objects with ``offsets`` and ``sizes``), in storage order:
            :meth:`overlapping` yields positions in this sequence (DCP's ``MetadataIndex.index``
            of a stored chunk), and reads only the candidates' entries.

    Building costs O(N) when the chunks come sorted along the sweep dimension (as pyckpt's
    writer emits them), O(N log N) otherwise; memory is two or three int64 arrays of N entries.
    """

    __slots__ = ("chunks", "dim", "_order", "_starts", "_reach")

    def __init__(self, shape: Sequence[int], chunks: Sequence[Any]) -> None:
        self.chunks = chunks
        self.dim = d = sweep_dim(shape, chunks)
        self._order: array[int] | None = None
        if d < 0:  # 0-d: every chunk overlaps every query (as in DCP)
            self._starts = self._reach = array("q")
            return
        starts = [c.offsets[d] for c in chunks]
        ends = [c.offsets[d] + c.sizes[d] for c in chunks]
        if not all(map(operator.le, starts, islice(starts, 1, None))):
            order = sorted(range(len(starts)), key=starts.__getitem__)
            starts = [starts[i] for i in order]
            ends = [ends[i] for i in order]
            self._order = array("q", order)
        self._starts = array("q", starts)
        self._reach = array("q", accumulate(ends, max))  # running max of the ends

    def __len__(self) -> int:
        return len(self.chunks)

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[int]:
        """Positions (in ``chunks``) of the stored chunks that overlap the box ``offsets`` +
        ``sizes``, in sweep order, by DCP's rule (``_check_shard_metadata_pair_overlap``: along
        every dimension each box starts before the other ends; so an empty box overlaps the
        chunks it lies strictly inside of, and an empty chunk the boxes it lies strictly inside
        of). O(log N) plus one visit per chunk that overlaps the box along the sweep dimension.
        """
        chunks = self.chunks
        d = self.dim
        if d < 0:
            yield from range(len(chunks))
            return
        lo = offsets[d]
        hi = lo + sizes[d]
        # Candidates: start < hi (a prefix of the sorted starts) and end > lo; the running max
        # of the ends is sorted, so the chunks before the first one reaching past lo end at or
        # before lo.
        first = bisect_right(self._reach, lo)
        last = bisect_left(self._starts, hi, first)
        order = self._order
        ndim = len(offsets)
        for j in range(first, last):
            i = order[j] if order is not None else j
            c = chunks[i]
            c_off = c.offsets
            c_size = c.sizes
            for k in range(ndim):
                a = offsets[k]
                b = c_off[k]
                if a >= b + c_size[k] or b >= a + sizes[k]:
                    break
            else:
                yield i
