"""pyckpt._partition: byte ranges tile every file, cuts sit on element boundaries, loads balance."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pyckpt._partition import WHOLE_FILE_SLACK, largest_first, name_shares, partition

ITEMS = st.sampled_from([1, 2, 4, 8])
TENSOR = st.tuples(st.integers(0, 5000), ITEMS).map(lambda t: (t[0] * t[1], t[1]))
FILES = st.lists(st.lists(TENSOR, min_size=0, max_size=6), min_size=1, max_size=6)


def _check_tiling(files, shares):
    per_file: dict[int, list[tuple[int, int]]] = {}
    for share in shares:
        for f, lo, hi in share:
            assert lo < hi
            per_file.setdefault(f, []).append((lo, hi))
    for f, tensors in enumerate(files):
        size = sum(n for n, _ in tensors)
        ranges = sorted(per_file.get(f, []))
        cursor = 0
        for lo, hi in ranges:
            assert lo == cursor
            cursor = hi
        assert cursor == size
        # Every boundary is an element boundary of the tensor holding it.
        bounds = {b for r in ranges for b in r}
        start = 0
        for n, item in tensors:
            for b in bounds:
                if start < b < start + n:
                    assert (b - start) % item == 0
            start += n


@given(FILES, st.integers(1, 6))
def test_ranges_tile_each_file(files, nranks):
    shares = partition(files, nranks)
    assert len(shares) == nranks
    _check_tiling(files, shares)


@given(FILES, st.integers(1, 6))
@example([[(15, 1), (192, 8), (10, 1), (192, 8)]], 5)  # loads 79, 80, 90, 80, 80
def test_balanced_when_feasible(files, nranks):
    total = sum(n for tensors in files for n, _ in tensors)
    shares = partition(files, nranks)
    loads = [sum(hi - lo for _, lo, hi in share) for share in shares]
    assert sum(loads) == total
    # Whole files when they balance within WHOLE_FILE_SLACK of the mean; else byte ranges: a
    # share's target is rounded down (< 1 byte) and each of its two cuts then moves to an
    # element boundary, by at most half an element (<= 4 bytes), so at most mean + 9 bytes.
    mean = total / nranks
    if mean >= 80:
        assert max(loads) <= max(WHOLE_FILE_SLACK * mean, mean + 9)


def test_whole_files_when_they_balance():
    files = [[(100, 1)], [(100, 1)], [(100, 1)], [(100, 1)]]
    shares = partition(files, 2)
    assert all(len(s) == 2 and all(lo == 0 and hi == 100 for _, lo, hi in s) for s in shares)


def test_single_file_split_by_byte_range():
    shares = partition([[(1000, 2), (24, 8)]], 4)
    assert [s for s in shares] == [[(0, 0, 256)], [(0, 256, 512)], [(0, 512, 768)], [(0, 768, 1024)]]


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="nranks"):
        partition([[(8, 8)]], 0)
    with pytest.raises(ValueError, match="bad tensor entry"):
        partition([[(6, 4)]], 1)


# ------------------------------------------------------------------------- largest_first


def _least_loaded_loop(sizes, bins, loads=None, allowed=None):
    """The loop the manager's upload and fetch shares were written as before they used
    largest_first: each item to the least loaded of its allowed bins, ties to the lower bin."""
    load = list(loads) if loads is not None else [0] * bins
    out = []
    for i, size in enumerate(sizes):
        ok = range(bins) if allowed is None else allowed[i]
        r = min(ok, key=lambda b: (load[b], b))
        out.append(r)
        load[r] += size
    return out


@pytest.mark.parametrize(
    "sizes,bins,loads,allowed,expected",
    [
        ([5, 4, 3, 3, 2, 1], 3, None, None, [0, 1, 2, 2, 1, 0]),
        ([7, 7, 7, 1], 2, None, None, [0, 1, 0, 1]),  # ties go to the lower bin
        ([10, 6, 6, 1], 3, [0, 5, 9], None, [0, 1, 2, 0]),  # loads before the first item
        ([8, 4, 4, 2], 3, None, [[1, 2], [0, 1], [2], [0, 1, 2]], [1, 0, 2, 0]),
        ([3, 3], 2, [4, 0], [[0, 1], [0]], [1, 0]),
        ([], 4, None, None, []),
    ],
)
def test_largest_first_pinned_assignments(sizes, bins, loads, allowed, expected):
    assert largest_first(sizes, bins, loads=loads, allowed=allowed) == expected


@given(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 6), st.data())
def test_largest_first_is_the_least_loaded_loop(sizes, bins, data):
    sizes = sorted(sizes, reverse=True)
    loads = data.draw(st.none() | st.lists(st.integers(0, 50), min_size=bins, max_size=bins))
    allowed = data.draw(st.none() | st.lists(
        st.lists(st.integers(0, bins - 1), min_size=1, max_size=bins, unique=True),
        min_size=len(sizes), max_size=len(sizes)))
    assert largest_first(sizes, bins, loads=loads, allowed=allowed) == _least_loaded_loop(
        sizes, bins, loads, allowed)


def test_name_shares_pinned():
    """Names largest first (ties by name), each to the least loaded allowed bin: the upload and
    fetch shares of the manager and the staging shares of a consolidation."""
    sizes = {"e": 1, "d": 3, "c": 3, "b": 4, "a": 5}
    assert name_shares(sizes, 2) == [["a", "d"], ["b", "c", "e"]]
    assert name_shares({"x": 2, "y": 2, "z": 9}, 3,
                       allowed=lambda n: [2] if n == "z" else [1, 2]) == [[], ["x", "y"], ["z"]]
    assert name_shares({}, 2) == [[], []]
