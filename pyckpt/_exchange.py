"""Chunk transfers between ranks: which rank holds each data file of a node-local checkpoint
(:func:`discover`), and rounds in which stored chunks travel over the process group
(:class:`Exchange`).

Used by the node-local backend (:mod:`pyckpt.backends.peer`), cooperative loads
(:mod:`pyckpt._coop`) and node-local consolidation (:mod:`pyckpt._consolidate.nodelocal`); it
knows no backend, only this rank's directory (``discover``) and a read function (``Exchange``).

Chunks travel as stored (compressed or raw) in rounds: in each round every rank all-gathers
what it needs from whom; each owner reads those chunks' stored bytes natively and verifies
their checksums (``_C.read_stored``); the bytes move with one ``all_to_all_single``; each
receiver verifies again and decodes natively straight into its destination
(``_C.read_requests(sources=...)``: the received buffer is a ``MemorySource`` whose bytes the
chunk path uses in place). Every rank takes part in every round; a rank with nothing left to
fetch keeps serving until all are done (:meth:`Exchange.finish`). Errors are agreed on: a
failure on any rank (reading, verifying, decoding) is raised on every rank at the next round,
so no rank is left waiting in a collective.

The group must support CPU tensors: callers pass pyckpt.coordination_group's (gloo) group.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any

from pyckpt import _C, _format
from pyckpt._collective import (
    Group,
    all_gather,
    all_to_all_single,
    broadcast,
    portable,
    raise_first,
)
from pyckpt.backends.base import ReadRequest, overlapping_chunks, stored_len

__all__ = ["Exchange", "Need", "PeerFiles", "discover", "peer_source", "read_requests",
           "writer_rank"]

# One chunk wanted from its owner: (file basename, chunk record tuple, codec params tuple[,
# the name of a tensor it belongs to, for the owner's error messages]).
Need = tuple[Any, ...]


class PeerFiles:
    """Where the data files of a node-local checkpoint are, from this rank's point of view.

    Attributes:
        root: this rank's checkpoint directory.
        group: the process group.
        owners: data file basename -> group rank that serves it.
        local: basenames present in ``root``.
        everywhere: every rank of the group holds every data file of the checkpoint (one
            shared directory, or complete copies): nothing needs to travel between ranks.
    """

    def __init__(self, root: str, group: Group, owners: dict[str, int], local: set[str],
                 everywhere: bool = False, holders: dict[str, list[int]] | None = None) -> None:
        self.root = root
        self.group = group
        self.owners = owners
        self.local = local
        self.everywhere = everywhere
        # data file basename -> every group rank holding it (readers of a cooperative load)
        self.holders = holders if holders is not None else {}

    def owner(self, path: str) -> int:
        """Group rank holding the data file ``path`` (this rank when it is local)."""
        name = os.path.basename(path)
        if name in self.local:
            return self.group.rank
        return self.owners[name]


def writer_rank(name: str) -> int:
    """The rank that wrote data file ``name`` (from ``<rank>-<k>.<save_id>.pyckpt``)."""
    return int(name.split("-", 1)[0])


def discover(root: str, group: Group) -> tuple[_format.CheckpointIndex, PeerFiles]:
    """Reads this rank's copy of the metadata and finds which rank holds each data file.

    Collective: every rank of ``group`` must call it once at the same point. A rank whose
    directory has no ``pyckpt.json`` (a node added since the save, or whose copy was lost) gets
    the copy of the lowest rank that has one, validated the same way. Any rank's failure is
    raised on every rank.

    Raises:
        FileNotFoundError: no rank has ``pyckpt.json``, or a data file is held by no rank (its
            ``filename``; the message names the rank that wrote it).
        CheckpointFormatError: the ranks' copies of ``pyckpt.json`` belong to different saves, or
            a copy is damaged.
    """
    meta = os.path.join(root, _format.METADATA_FILE)
    index: _format.CheckpointIndex | None = None
    error: BaseException | None = None
    try:
        index = _format.read_index(root, all_files=False)
    except FileNotFoundError as e:
        if e.filename != meta:
            error = e
    except Exception as e:
        error = e
    try:
        present = sorted(n for n in os.listdir(root) if _format.is_data_file(n))
    except FileNotFoundError:
        present = []
    mine = (None if index is None else index.save_id, present,
            None if error is None else portable(error))
    gathered = all_gather(mine, group, what="reading the node-local metadata")
    raise_first([e for _, _, e in gathered], error, "reading the node-local metadata")
    save_ids = {r: sid for r, (sid, _, _) in enumerate(gathered) if sid is not None}
    if not save_ids:
        raise FileNotFoundError(
            errno.ENOENT,
            f"not a complete pyckpt checkpoint on any rank: {_format.METADATA_FILE} is missing",
            meta,
        )
    if len(set(save_ids.values())) != 1:
        from pyckpt.errors import CheckpointFormatError

        raise CheckpointFormatError(
            f"{root}: the ranks' copies of {_format.METADATA_FILE} belong to different saves "
            f"(save id by rank: {save_ids}); a save did not complete on every node"
        )
    if len(save_ids) < group.world:  # some ranks have no copy: the lowest holder sends it
        src = min(save_ids)
        document = None
        if group.rank == src:
            with open(meta, "rb") as fh:
                document = fh.read()
        document = broadcast(document, group, src, what="sending the node-local metadata")
        if index is None:
            index = _format.read_index(root, all_files=False, document=document)
    assert index is not None
    owners: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    for r, (_, names, _) in enumerate(gathered):
        for name in names:
            owners.setdefault(name, r)
            holders.setdefault(name, []).append(r)
    for name in sorted(index.files):
        if name not in owners:
            raise FileNotFoundError(
                errno.ENOENT,
                f"data file {name} of the node-local checkpoint {root!r}, written by rank "
                f"{writer_rank(name)}, is held by no rank of the group (that node's directory "
                "is missing or incomplete)",
                os.path.join(root, name),
            )
    wanted = set(index.files)
    everywhere = all(wanted <= set(names) for _, names, _ in gathered)
    return index, PeerFiles(root, group, owners, set(index.local_files), everywhere, holders)


class Exchange:
    """Rounds of chunk transfers between the ranks of a node-local checkpoint.

    Every rank calls :meth:`fetch` any number of times (one round each), then :meth:`finish`,
    which keeps serving the others until every rank has finished. A rank must not call
    collectives of its own in between.
    """

    def __init__(self, files: PeerFiles, pool: Any) -> None:
        self.files = files
        self.pool = pool
        self.bytes_received = 0
        self.bytes_sent = 0
        self.bytes_read = 0  # stored bytes this rank read from storage for the others
        self._round = 0
        # Set once a round has raised a failure: every rank raised it in that same round, so
        # no further round may run (a rank calling finish() then would wait for the others).
        self._failed = False

    def fetch(self, needs: Sequence[Need]) -> tuple[dict[str, Any], list[int]]:
        """One round: fetches ``needs`` (grouped and ordered by owner as given).

        Returns:
            ``(memory, offsets)``: source name -> received buffer (a ``uint8`` tensor) for
            ``_C.read_requests(sources=...)``, and for each need the offset of its stored bytes in
            the buffer named ``peer_source(owner)``.
        """
        memory, offsets, _ = self._step(list(needs), done=False, error=None)
        return memory, offsets

    def finish(self, error: BaseException | None = None) -> None:
        """Serves the other ranks until all are done; raises the first failure of any rank.

        After a round has already raised a failure (on every rank at once), returns at once.
        """
        if self._failed:
            return
        while True:
            _, _, all_done = self._step([], done=True, error=error)
            error = None
            if all_done:
                return

    # -- one round ---------------------------------------------------------------------------

    def _step(
        self, needs: list[Need], done: bool, error: BaseException | None
    ) -> tuple[dict[str, Any], list[int], bool]:
        import torch

        group = self.files.group
        me = group.rank
        self._round += 1
        wire = [(self.owner_of(n), *n) for n in needs]
        gathered = all_gather((wire, done, None if error is None else portable(error)), group,
                              what="a node-local transfer")
        self._raise_first(gathered, error, "a node-local transfer")
        all_done = all(d for _, d, _ in gathered)
        if all(not w for w, _, _ in gathered):
            return {}, [], all_done

        # Owner side: read and verify what each rank wants from this one, back to back.
        send_sizes = [sum(stored_len(n[2]) for n in gathered[r][0] if n[0] == me)
                      for r in range(group.world)]
        send = torch.empty(sum(send_sizes), dtype=torch.uint8)
        read_error: BaseException | None = None
        try:
            # Each chunk is read once per round, however many ranks asked for it.
            first: dict[tuple[str, int], int] = {}  # chunk -> its position in `send`
            copies: list[tuple[int, int, int]] = []  # (from, to, length) within `send`
            requests = []
            pos = 0
            for r in range(group.world):
                # One request per chunk, named after its tensor (an error names it); a chunk
                # several ranks asked for in this round is read once and copied.
                for o, name, rec, params, *label in gathered[r][0]:
                    if o != me:
                        continue
                    n = stored_len(rec)
                    at = first.setdefault((name, rec[0]), pos)
                    if at == pos:
                        seg = _C.Segment(self.path_of(name), 0, params, [rec])
                        what = label[0] if label else f"chunks for rank {r}"
                        requests.append(ReadRequest(what, [seg], 0, 0, send.data_ptr() + pos))
                    else:
                        copies.append((at, pos, n))
                    pos += n
            if requests:
                self.bytes_read += self.read_stored(requests).bytes_read
            for src, dst, n in copies:
                send[dst:dst + n] = send[src:src + n]
        except Exception as e:
            read_error = e
        statuses = all_gather((None, True, None if read_error is None else portable(read_error)),
                              group, what="a node-local transfer")
        self._raise_first(statuses, read_error, "reading chunks for a peer")

        # Receiver side: what each owner sends, in the order asked.
        recv_sizes = [0] * group.world
        offsets = []
        for owner, _, rec, *_ in wire:
            offsets.append(recv_sizes[owner])
            recv_sizes[owner] += stored_len(rec)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        all_to_all_single(recv, send, recv_sizes, send_sizes, group, what="a node-local transfer")
        self.bytes_sent += sum(send_sizes)
        self.bytes_received += sum(recv_sizes)
        memory = {}
        start = 0
        for owner, size in enumerate(recv_sizes):
            if size:
                memory[peer_source(owner)] = recv[start:start + size].numpy()
            start += size
        return memory, offsets, all_done

    # -- what a subclass may change: who serves a chunk, and how its owner reads it ---------

    def owner_of(self, need: Need) -> int:
        """Group rank that serves ``need`` (default: the rank holding its file)."""
        return self.files.owner(os.path.join(self.files.root, need[0]))

    def path_of(self, name: str) -> str:
        """The segment path of data file ``name`` on the serving rank."""
        return os.path.join(self.files.root, name)

    def read_stored(self, requests: list[ReadRequest]) -> _C.ReadStats:
        """As ``_C.read_stored`` (files in this rank's directory)."""
        return _C.read_stored(requests, self.pool)

    def _raise_first(self, gathered: list[tuple[Any, bool, BaseException | None]],
                     mine: BaseException | None, what: str) -> None:
        """:func:`~pyckpt._collective.raise_first` over a round's outcomes; a failure ends
        the exchange (:meth:`finish` then returns at once)."""
        try:
            raise_first([e for _, _, e in gathered], mine, what)
        except BaseException:
            self._failed = True
            raise


def peer_source(owner: int) -> str:
    """Name of the in-memory source holding the bytes received from ``owner`` in a round."""
    return f"<chunks from rank {owner}>"


def read_requests(
    exchange: Exchange, requests: Sequence[ReadRequest], pool: Any
) -> _C.ReadStats:
    """``_C.read_requests`` for a node-local checkpoint: one :meth:`Exchange.fetch` round.

    Chunks of local files are read from disk; the chunks of other ranks' files that overlap a
    request are fetched from their owners and decoded from the received buffer. Collective: one
    round per call (see :class:`Exchange`).
    """
    files = exchange.files
    needs: list[Need] = []
    where: dict[tuple[str, int], int] = {}  # (file, file_offset) -> index in needs
    plans = []
    for name, segments, lo, hi, dst in requests:
        remote: dict[int, list[tuple[int, Any]]] = {}
        local = []
        for si, seg in enumerate(segments):
            if files.owner(seg[0]) == files.group.rank:
                local.append(seg)
            else:
                remote[si] = []
        for a, _b, si, rec in overlapping_chunks(segments, lo, hi):
            picked = remote.get(si)
            if picked is None:
                continue
            key = (os.path.basename(segments[si][0]), rec[0])
            if key not in where:
                where[key] = len(needs)
                needs.append((key[0], tuple(rec), segments[si][2], name))
            picked.append((a, rec))
        remote_segs = list(remote.items())
        plans.append((name, segments, lo, hi, dst, local, remote_segs))
    memory, offsets = exchange.fetch(needs)
    out = []
    for name, segments, lo, hi, dst, local, remote_segs in plans:
        segs = list(local)
        for si, picked in remote_segs:
            path, _, params, _ = segments[si]
            owner = files.owner(path)
            for a, rec in picked:
                off = offsets[where[(os.path.basename(path), rec[0])]]
                chunk = _C.Chunk(off, *rec[1:])  # at its place in the received bytes
                segs.append(_C.Segment(peer_source(owner), a, params, [chunk]))
        out.append(ReadRequest(name, segs, lo, hi, dst))
    sources = {name: _C.MemorySource(buf.nbytes, [_C.MemoryRange(0, buf)])
               for name, buf in memory.items()}
    return _C.read_requests(out, pool, sources)
