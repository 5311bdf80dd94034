"""Consolidation of a node-local checkpoint: each rank sees only its own node's files.

Output files are whole-file assigned to ranks by bytes (``make_plan(whole_files=True)``); each
rank creates, writes and commits its files in its own ``dst``. The stitch items of a rank that
read chunks of data files held by another rank are served over the process group
(:class:`pyckpt._exchange.Exchange`) in batches of at most ``batch_bytes`` stored bytes: the owner
reads and verifies the stored (compressed) bytes, they travel with one ``all_to_all_single``
per round, the receiver stages the batch in a hidden file next to its outputs (the stitcher
reads its sources through files) and stitches from it natively: checksum verified again,
decoded, scattered into the outputs. Chunks of local files are stitched straight from disk.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any, cast

from pyckpt import _C
from pyckpt._consolidate.plan import _Plan
from pyckpt._consolidate.run import ProgressFn, StitchItem, is_chunk, stitch, stitch_items
from pyckpt._exchange import Exchange, Need, PeerFiles, peer_source
from pyckpt.backends.base import stored_len
from pyckpt.errors import PyckptError

__all__ = ["run_share_nodelocal", "DEFAULT_BATCH_BYTES"]

#: Stored bytes a rank fetches from its peers per round (default of ``batch_bytes``).
DEFAULT_BATCH_BYTES = 64 << 20


def _chunk(item: StitchItem) -> _C.StitchChunk:
    """The chunk an item copies from (every item here is one: see run_share_nodelocal)."""
    return cast(_C.StitchChunk, item.at)


def _batches(
    items: list[StitchItem],
    files: PeerFiles,
    exchange: Exchange,
    src: str,
    dst: str,
    batch_bytes: int,
) -> Iterator[list[StitchItem]]:
    """Yields the local items first, then the remote ones batch by batch, fetching each batch
    (one exchange round) and staging its bytes in a hidden file in ``dst``."""
    local, remote = [], []
    for item in items:
        if files.owner(item.source) == files.group.rank:
            local.append(item._replace(source=os.path.join(src, os.path.basename(item.source))))
        else:
            remote.append(item)
    yield local
    stage = os.path.join(dst, f".peer-chunks.tmp-{uuid.uuid4().hex[:12]}")
    try:
        start = 0
        while start < len(remote):
            end, size = start, 0
            while end < len(remote) and (end == start or size + stored_len(_chunk(remote[end]).chunk)
                                         <= batch_bytes):
                size += stored_len(_chunk(remote[end]).chunk)
                end += 1
            batch = remote[start:end]
            start = end
            needs: list[Need] = []
            where: dict[tuple[str, int], int] = {}
            for item in batch:
                rec, params = _chunk(item)
                key = (os.path.basename(item.source), rec[0])
                if key not in where:
                    where[key] = len(needs)
                    needs.append((key[0], tuple(rec), params, item.name))
            memory, offsets = exchange.fetch(needs)
            # Stage the received bytes: owners in rank order, back to back.
            base: dict[str, int] = {}
            with open(stage, "wb") as fh:
                for owner_source, buf in memory.items():
                    base[owner_source] = fh.tell()
                    fh.write(memoryview(buf))
            out = []
            for item in batch:
                rec, params = _chunk(item)
                owner = files.owner(item.source)
                off = base[peer_source(owner)] + offsets[where[(os.path.basename(item.source),
                                                                rec[0])]]
                chunk = _C.Chunk(off, *rec[1:])  # at its place in the staged file
                out.append(item._replace(source=stage, at=_C.StitchChunk(chunk, params)))
            del memory
            yield out
    finally:
        try:
            os.unlink(stage)
        except FileNotFoundError:
            pass


def run_share_nodelocal(
    plan: _Plan,
    src: str,
    dst: str,
    files: PeerFiles,
    pool: Any,
    threads: int,
    fsync: bool,
    progress: ProgressFn | None,
    input_mode: str,
    batch_bytes: int,
) -> int:
    """Stitches this rank's whole files, fetching remote chunks from their owners.

    Collective (exchange rounds): every rank of the group must call it. Returns the bytes
    written. A failure on any rank is raised on every rank.
    """
    share = plan.shares[files.group.rank]
    total = sum(hi - lo for _, lo, hi in share)
    exchange = Exchange(files, pool)
    try:
        items = stitch_items(plan, dst, share)
        if not all(is_chunk(item) for item in items):
            raise ValueError("shared_filesystem=False needs a pyckpt checkpoint as input")
        done = stitch(_batches(items, files, exchange, src, dst, batch_bytes), threads, fsync,
                      progress, input_mode, total, partial=True)
        if done != total:
            raise PyckptError(f"stitched {done} bytes, expected {total}")
    except Exception as e:
        exchange.finish(e)
        raise
    exchange.finish()
    return total
