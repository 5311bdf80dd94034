"""Byte-balanced partition of consolidation output among ranks (pure Python, no torch).

The unit of work is an output byte: every byte of a tensor's data is read once from the inputs and
written once to the output, so balancing output bytes balances both reads and writes.

:func:`partition` first tries whole files, longest-processing-time first (each file goes to the
least-loaded rank): files then need no coordination between ranks. When that leaves a rank more
than :data:`WHOLE_FILE_SLACK` above the mean (typically one dominant file, e.g. a single output
file), it falls back to cutting the concatenation of all files (largest first) into ``n`` equal
byte ranges, each cut moved to the nearest element boundary of the tensor it falls in. Every rank
then owns one contiguous range that may span several files or split one file or tensor, and the
imbalance is at most one element per cut.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

__all__ = ["WHOLE_FILE_SLACK", "largest_first", "name_shares", "partition"]

#: Accept a whole-file assignment when the most loaded rank is within this factor of the mean.
WHOLE_FILE_SLACK = 1.05

# (file index, lo, hi): a byte range of one file's data section.
Range = tuple[int, int, int]


def _snap(pos: int, tensors: Sequence[tuple[int, int]]) -> int:
    """Moves a data-section offset to the nearest element boundary of the tensor holding it."""
    start = 0
    for nbytes, item in tensors:
        end = start + nbytes
        if pos <= end:
            if pos == start or pos == end:
                return pos
            k = round((pos - start) / item)
            return start + k * item
        start = end
    return start


def largest_first(
    sizes: Sequence[int],
    bins: int,
    *,
    loads: Sequence[int] | None = None,
    allowed: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Greedy bin packing: each item, in the order given (callers pass largest first), goes to
    the least loaded bin, ties to the lower bin. Returns the bin of each item. The one
    implementation of this balancing (consolidation outputs, objects staged by rank, readers of
    a cooperative load).

    Args:
        loads: each bin's load before the first item (default 0).
        allowed: per item, the bins it may go to (default any).
    """
    start = list(loads) if loads is not None else [0] * bins
    out = []
    if allowed is not None:
        for size, ok in zip(sizes, allowed):
            r = min(ok, key=lambda b: (start[b], b))
            out.append(r)
            start[r] += size
        return out
    heap = [(start[r], r) for r in range(bins)]
    heapq.heapify(heap)
    for size in sizes:
        load, r = heapq.heappop(heap)
        out.append(r)
        heapq.heappush(heap, (load + size, r))
    return out


def name_shares(sizes: Mapping[str, int], bins: int, *,
                allowed: Callable[[str], Sequence[int]] | None = None) -> list[list[str]]:
    """The names of ``sizes`` by bin, balanced by size: largest first (ties by name), each to
    the least loaded bin (:func:`largest_first`); deterministic.

    Args:
        allowed: per name, the bins it may go to (default any).
    """
    names = sorted(sizes, key=lambda n: (-sizes[n], n))
    bins_of = largest_first([sizes[n] for n in names], bins,
                            allowed=None if allowed is None else [allowed(n) for n in names])
    out: list[list[str]] = [[] for _ in range(bins)]
    for name, b in zip(names, bins_of):
        out[b].append(name)
    return out


def partition(
    files: Sequence[Sequence[tuple[int, int]]], nranks: int, *, whole_files: bool = False
) -> list[list[Range]]:
    """Splits the data sections of ``files`` among ``nranks`` ranks, balanced by bytes.

    Args:
        files: per output file, its tensors in data-section order as ``(nbytes, item_bytes)``
            (``item_bytes >= 1``; every ``nbytes`` a multiple of it).
        nranks: number of ranks (>= 1).
        whole_files: always keep every file on one rank (the whole-file assignment, balanced
            or not), e.g. when each rank writes into its own local directory.

    Returns:
        Per rank, a list of ``(file_index, lo, hi)`` ranges (``lo < hi``) of the files' data
        sections. For every file the ranges of all ranks tile ``[0, size)`` exactly, and every
        range boundary is an element boundary of the tensor it falls in.

    Raises:
        ValueError: on ``nranks < 1`` or a malformed tensor entry.
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    sizes = []
    for tensors in files:
        total = 0
        for nbytes, item in tensors:
            if item < 1 or nbytes < 0 or nbytes % item:
                raise ValueError(f"bad tensor entry (nbytes={nbytes}, item_bytes={item})")
            total += nbytes
        sizes.append(total)
    out: list[list[Range]] = [[] for _ in range(nranks)]
    total = sum(sizes)
    order = sorted(range(len(files)), key=lambda i: (-sizes[i], i))
    order = [i for i in order if sizes[i] > 0]
    if total == 0:
        return out

    loads = [0] * nranks
    owner = dict(zip(order, largest_first([sizes[i] for i in order], nranks)))
    for i, r in owner.items():
        loads[r] += sizes[i]
    if whole_files or max(loads) <= WHOLE_FILE_SLACK * total / nranks:
        for i in order:
            out[owner[i]].append((i, 0, sizes[i]))
        return out

    # Contiguous split of the concatenation, cuts snapped to element boundaries.
    starts = {}
    pos = 0
    for i in order:
        starts[i] = pos
        pos += sizes[i]
    cuts = [0]
    for r in range(1, nranks):
        target = (r * total) // nranks
        snapped = target
        for i in order:
            if starts[i] <= target <= starts[i] + sizes[i]:
                snapped = starts[i] + _snap(target - starts[i], files[i])
                break
        cuts.append(max(cuts[-1], snapped))
    cuts.append(total)
    for r in range(nranks):
        lo, hi = cuts[r], cuts[r + 1]
        for i in order:
            a = max(lo, starts[i])
            b = min(hi, starts[i] + sizes[i])
            if a < b:
                out[r].append((i, a - starts[i], b - starts[i]))
    return out
