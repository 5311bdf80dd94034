"""Restore of :class:`pyckpt.CheckpointManager`: what each node's fast tier holds, which
steps are complete considering the surviving nodes, damaged copies set aside, the durable
listing with its deadline, and loading a step from either tier."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyckpt import _format, _loaddrive
from pyckpt._collective import agree
from pyckpt._manager.base import ManagerBase
from pyckpt._manager.info import RestoreInfo
from pyckpt._partition import name_shares
from pyckpt._tier_io import DAMAGED_SUFFIX, StepView
from pyckpt.api import _single_process_quiet, _typed_errors, load_planner
from pyckpt.errors import (
    CheckpointFormatError,
    CompressionError,
    JobMismatchError,
    TierWarning,
    find_error,
)
from pyckpt.storage import Reader

__all__ = ["Restoring", "DURABLE_LIST_DEADLINE_S", "damaged"]


#: Seconds a restore waits for the durable tier's listing (retries included) when the fast
#: tier has a complete step to restore: a durable store that is down or frozen does not hold up
#: a recovery the fast tier can serve.
DURABLE_LIST_DEADLINE_S = 10.0


def damaged(exc: BaseException) -> bool:
    """Whether a failed fast-tier load may be a damaged copy (a checksum, format or I/O error
    of a file), rather than a lost peer or an interrupt."""
    return find_error(exc, (CheckpointFormatError, CompressionError, OSError)) is not None


def lost_or_damaged(exc: BaseException) -> bool:
    """Whether a failed durable load says that copy of the step is lost or damaged (a missing
    file, a checksum or format error), rather than the store being out of reach (a network
    error: an older step of the same store would fail alike, so it is raised)."""
    return find_error(exc, (CheckpointFormatError, CompressionError, FileNotFoundError,
                            IsADirectoryError, NotADirectoryError)) is not None


@dataclass
class _FastStep:
    save_id: str
    files: dict[str, int]
    holders: dict[str, list[str]] = field(default_factory=dict)
    note: str | None = None  # for a TierWarning when this step is restored


class Restoring(ManagerBase):
    """The steps of :meth:`pyckpt.CheckpointManager.restore` (collective, on the fast-tier
    group)."""

    def _gather_views(self, skipped: list[str]) -> list[dict[int, StepView]]:
        """What every rank sees of its node's fast tier (one all-gather). Copies the scan found
        damaged (a data file that does not match its metadata, a ``pyckpt.json`` that cannot
        be read) are set aside on their node, each named in a ``TierWarning`` and in
        ``skipped``: the views already leave them out."""
        g = self._group
        tier = self.tier
        if tier is not None:  # a step saved again whose move a crash cut short is moved in
            agree(lambda: tier.recover() if self._leader else None, g,
                  what="completing the moves of fast-tier steps saved again")
        _, all_views = agree(lambda: {} if tier is None else tier.scan(), g,
                             what="listing the fast tier")
        found: list[tuple[int, int, str, str, str]] = []  # (rank, step, name, path, why)
        for r, v in enumerate(all_views):
            if self.nodes.index(self.nodes[r]) != r:
                continue  # a node's first rank speaks for it
            for s, view in sorted(v.items()):
                bad = dict(view.damaged)
                if view.metadata_error is not None:
                    bad[_format.METADATA_FILE] = view.metadata_error
                found += [(r, s, n, os.path.join(view.path, n), why)
                          for n, why in sorted(bad.items())]
        if not found or tier is None:
            return all_views

        def set_aside() -> None:
            for r, s, name, _, _ in found:
                if r == g.rank:
                    tier.set_aside(s, name)

        agree(set_aside, g, what="setting damaged fast-tier copies aside")
        for r, s, _, path, why in found:
            line = (f"node {self.nodes[r]!r}: {path} is damaged ({why}); set aside as "
                    f"{path}{DAMAGED_SUFFIX}")
            skipped.append(line)
            warnings.warn(TierWarning(f"pyckpt: fast-tier step {s}: {line}; the restore uses "
                                      "the next good copy"), stacklevel=3)
        return all_views

    def _list_durable(self, have_fast: bool) -> tuple[list[int], str | None]:
        """The committed durable steps (listed by rank 0, after checking the tier's job) and,
        when ``have_fast`` (a fast-tier step to fall back on) and the listing failed or took
        longer than :data:`DURABLE_LIST_DEADLINE_S`, why (with no steps). Without a fast-tier
        step the listing waits the backend's full retry budget and its failure is raised."""
        deadline = DURABLE_LIST_DEADLINE_S if have_fast else None

        def listing() -> tuple[list[int], str | None]:
            try:
                self.store.check_job(deadline)
                listed = self.store.list_steps(deadline)
            except JobMismatchError:
                raise
            except Exception as e:
                if deadline is None:
                    raise
                return [], f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return sorted(s for s, done in listed.items() if done), None

        got, _ = agree(listing, self._group, ranks="root",
                       what=f"listing the durable steps of {self.store.url}")
        assert got is not None
        return got

    def _set_aside_damaged(self, step: int, error: BaseException) -> list[str]:
        """After a failed load of fast-tier ``step``: each node checks its copies of the step
        (``pyckpt.json`` and every data file) and sets aside the damaged ones, so the next
        attempt reads a replica (or, with none left, falls back to an older step or the
        durable tier). Returns sentences naming each copy set aside (the same on every rank)."""
        tier = self.tier
        assert tier is not None

        def check() -> list[str]:
            out: list[str] = []
            if not self._leader:
                return out
            view = tier.view(step)
            bad = dict(view.damaged)
            if view.metadata_error is not None:
                bad[_format.METADATA_FILE] = view.metadata_error
            else:
                bad.update(tier.damaged_files(step))
            for name, why in sorted(bad.items()):
                path = tier.set_aside(step, name)
                out.append(f"node {self.node!r}: {tier.file_path(step, name)} is damaged "
                           f"({why}); set aside as {path}")
            return out

        _, found = agree(check, self._group, what=f"checking fast-tier step {step}'s copies")
        return [line for lines in found for line in lines]

    def _fast_steps(self, views: Sequence[dict[int, StepView]]) -> tuple[dict[int, _FastStep], str]:
        """Fast-tier steps complete considering the surviving nodes, and why the newest step
        the fast tier has any trace of is not (a sentence for the warning)."""
        out: dict[int, _FastStep] = {}
        reasons: dict[int, str] = {}
        for s in sorted({s for v in views for s in v}):
            here = [v[s] for v in views if s in v]
            marked: dict[str, set[str]] = {}  # save id -> nodes with its marker
            for r, v in enumerate(views):
                mark = v[s].marker if s in v else None
                if mark is not None:
                    marked.setdefault(mark["save_id"], set()).add(self.nodes[r])
            if not marked:
                reasons[s] = (f"step {s} has no completion marker on any surviving node (its "
                              "replication or commit did not finish)")
                continue
            # Markers of two saves: a crash between the nodes' moves of a step saved again.
            # Each save is complete on its own when the nodes hold all of its files (their
            # names are its own); the save marked on the most nodes is taken first.
            held = {n for v in here for n in v.present}
            for sid in sorted(marked, key=lambda x: -len(marked[x])):
                files = next((v.files for v in here if v.save_id == sid and v.files), None)
                missing = None if files is None else sorted(set(files) - held)
                if files is None:
                    reasons[s] = f"step {s}: no surviving node has its metadata"
                elif missing:
                    reasons[s] = (f"step {s}: data files {missing} are held by no surviving "
                                  "node (every copy was lost)")
                else:
                    note = None if len(marked) == 1 else (
                        f"fast-tier step {s} has markers of {len(marked)} saves (a crash while "
                        f"it was saved again); restoring save {sid}, complete on its own")
                    out[s] = _FastStep(sid, files, note=note)
                    reasons.pop(s, None)
                    break
        newest = max(reasons, default=None)
        if newest is not None and (not out or newest > max(out)):
            lacked = reasons[newest]
        elif not any(views):
            lacked = "the fast tier is empty on every node"
        else:
            lacked = "its newest complete step is older"
        return out, lacked

    def _prepare_dirs(self, step: int, save_id: str) -> None:
        """Before a node-local load of ``step``: a node whose copy belongs to another save
        drops it; every rank has the step's directory (empty on a new node)."""
        tier, g = self.tier, self._group
        assert tier is not None

        def drop_stale() -> None:
            if self._leader:
                sid = tier.view(step).save_id
                if sid is not None and sid != save_id:
                    tier.remove(step)

        agree(drop_stale, g, what=f"preparing to restore step {step}")
        agree(lambda: tier.ensure(step), g, what=f"preparing to restore step {step}")

    def _node_local_load(self, state: Any, step: int, info: RestoreInfo,
                         allow_partial: bool) -> None:
        assert self.tier is not None
        g = self._group
        # Not cooperative: each piece comes from this node's copy or from one holder's, and
        # last_restore reports local / peer bytes per rank (a cooperative read would mix them).
        reader = Reader(self.tier.step_dir(step), shared_filesystem=False,
                        process_group=g.pg, cooperative=False, allow_partial=allow_partial)
        with reader, _single_process_quiet(), _typed_errors():
            _loaddrive.run(state, reader, load_planner(), g)  # plans cached per layout
        info.bytes_peer = reader.bytes_from_peers
        info.bytes_local = max(0, reader.bytes_read - reader.bytes_from_peers)

    def _load_fast(self, state: Any, step: int, save_id: str,
                   allow_partial: bool) -> RestoreInfo:
        info = RestoreInfo(step, "fast")
        self._prepare_dirs(step, save_id)
        agree(lambda: self._node_local_load(state, step, info, allow_partial), self._group,
              what=f"restoring fast-tier step {step}")
        return info

    def _load_durable(self, state: Any, step: int, views: Sequence[dict[int, StepView]],
                      allow_partial: bool) -> RestoreInfo:
        info = RestoreInfo(step, "durable")
        g = self._group
        partial = self.tier is not None and any(v[step].present for v in views if step in v)
        document = None
        if partial:  # are the pieces the nodes still hold of this very save?
            def read_doc() -> tuple[bytes, str, dict[str, int]]:
                assert self.tier is not None
                doc = self.store.read_metadata(step)
                idx = _format.read_index(self.tier.step_dir(step), all_files=False,
                                         document=doc)
                return doc, idx.save_id, dict(idx.files)

            got, _ = agree(read_doc, g, ranks="root", what=f"reading step {step}'s metadata")
            assert got is not None
            document, save_id, files = got
            held = {n for v in views if step in v for n in v[step].present if n in files}
            partial = bool(held)
        if not partial:
            with Reader(self.store.step_location(step), allow_partial=allow_partial,
                        storage_options=self.store.storage_options or None) as reader, \
                    _single_process_quiet(), _typed_errors():
                _loaddrive.run(state, reader, load_planner(), g)
            nbytes = reader.bytes_fetched or reader.bytes_read
            info.bytes_durable = nbytes
            self.store.count_direct_load(nbytes)
            return info
        # Fetch only the data files no node holds, into the fast tier, then load from there.
        assert self.tier is not None and document is not None
        tier = self.tier
        self._prepare_dirs(step, save_id)
        missing = {n: s for n, s in files.items() if n not in held}
        mine = name_shares(missing, g.world)[g.rank]

        def fetch() -> int:
            total = 0
            meta = tier.file_path(step, _format.METADATA_FILE)
            if self._leader and not os.path.exists(meta):
                tier.write_metadata(step, document)
            for name in mine:
                total += self.store.fetch_file(step, name, tier.file_path(step, name))
            return total

        fetched, _ = agree(fetch, g, what=f"fetching step {step}'s lost files from "
                                          f"{self.store.url}")
        info.bytes_durable = fetched or 0
        self._node_local_load(state, step, info, allow_partial)
        return info

    def _drop_newer(self, step: int | None, durable: bool = False) -> None:
        """After a restore of ``step``: deletes this node's fast-tier steps newer than it (they
        are incomplete, or of a run rolled back; the training will save those steps again);
        ``durable``: a rollback, the durable tier's newer steps too (rank 0)."""
        tier = self.tier
        if step is None:
            return
        if durable:
            def drop_durable() -> None:
                for s in self.store.list_steps():
                    if s > step:
                        self.store.remove(s)

            agree(drop_durable, self._group, ranks="root",
                  what=f"deleting the durable steps newer than step {step}")
        if tier is None:
            return

        def drop() -> None:
            if self._leader:
                for s in tier.steps():
                    if s > step:
                        tier.remove(s)

        agree(drop, self._group, what="deleting fast-tier steps newer than the one restored")
