"""Persistence of :class:`pyckpt.CheckpointManager`: copying committed fast-tier steps to
the durable tier in the background, one at a time, a newer due step superseding a pending one.
"""

from __future__ import annotations

from concurrent.futures import Future, wait

from pyckpt import _format
from pyckpt._collective import add_note, agree
from pyckpt._manager.groups import peer_typed
from pyckpt._manager.retention import Retention
from pyckpt._partition import name_shares
from pyckpt.backends import SaveState
from pyckpt.errors import PyckptError

__all__ = ["Persistence"]


class _SavedAgain(PyckptError):
    """The fast-tier step being persisted was saved again (a new copy moved in place): that
    copy is due for persistence itself, so this one is superseded, not failed."""


class Persistence(Retention):
    """Queues and runs the durable tier's copies of fast-tier steps (on the persistence thread
    and group)."""

    def _queue_persist(self, step: int, files: dict[str, int],
                       holders: dict[str, list[str]]) -> None:
        """Makes committed fast-tier step ``step`` the pending persistence (superseding an
        older pending one) and queues a persistence task; never waits for the durable tier."""
        with self._pinned_lock:
            dropped = [s for s, _, _ in self._pending if s != step]
            self._pending = [(step, files, holders)]
            busy = self._in_flight
        for s in dropped:
            self._notice(f"pyckpt: fast-tier step {s} was not persisted to {self.store.url}: "
                         f"step {step} supersedes it (the durable tier was still busy"
                         + (f" persisting step {busy})" if busy is not None else ")"))
        try:
            self._persist_future = self._persist_ex.submit(self._persist_next, step)
        except RuntimeError:
            # The interpreter is exiting (a manager not closed) and takes no new work: the
            # step is persisted here, on the save thread the exit waits for, not lost; after
            # the persistences queued before it (the lane runs them in order, on one group).
            if self._persist_future is not None:
                wait([self._persist_future])
            fut: Future[int | None] = Future()
            try:
                fut.set_result(self._persist_next(step))
            except Exception as e:
                fut.set_exception(e)
            self._persist_future = fut

    def _persist_next(self, due: int) -> int | None:
        """One persistence task (one per due step, run in order on every rank): the ranks
        agree on the newest step every rank has pending (their pending steps can differ for a
        moment: each rank queues a step once its fast-tier commit returns) and persist it;
        pending steps older than it are superseded. None when no step is pending everywhere
        (an earlier task took it, or a later one will)."""
        g, step = self._persist_group, None
        try:
            with self._pinned_lock:
                mine = [s for s, _, _ in self._pending]
            _, lists = agree(lambda: mine, g, what=f"choosing the step to persist ({due} due)")
            common = set(lists[0]).intersection(*lists[1:]) if lists and lists[0] else set()
            if not common:
                return None
            step = max(common)
            with self._pinned_lock:
                superseded = [s for s, _, _ in self._pending if s < step]
                _, files, holders = next(e for e in self._pending if e[0] == step)
                self._pending = [e for e in self._pending if e[0] > step]
                self._in_flight = step
            for s in superseded:
                self._notice(f"pyckpt: fast-tier step {s} was not persisted to "
                             f"{self.store.url}: step {step} supersedes it")
            return self._persist(step, files, holders)
        except _SavedAgain as e:
            self._notice(f"pyckpt: {e}")
            return None
        except Exception as e:
            add_note(e, f"pyckpt: persisting step {step if step is not None else due} to "
                        f"{self.store.url} failed (the newest step persisted by this manager: "
                        f"{self.last_persisted})")
            with self._pinned_lock:
                self._failures.append(e)
            raise
        finally:
            if step is not None:
                with self._pinned_lock:
                    self._in_flight = None

    def _saved_again(self, step: int, files: dict[str, int]) -> bool:
        """Whether fast-tier ``step`` on this node now holds another save than ``files``."""
        assert self.tier is not None
        try:
            idx = _format.read_index(self.tier.step_dir(step), all_files=False)
        except (OSError, ValueError):
            return False
        return dict(idx.files) != files

    @peer_typed("_persist_group", "persisting a step")
    def _persist(self, step: int, files: dict[str, int], holders: dict[str, list[str]]) -> int:
        """Copies fast-tier step ``step`` to the durable tier: each rank uploads the files
        assigned to it (balanced by bytes among the ranks whose node holds the file), then
        rank 0 commits ``pyckpt.json`` there and applies durable retention."""
        tier, g, store = self.tier, self._persist_group, self.store
        assert tier is not None
        states: list[SaveState] = []  # this rank's save set-up (rank 0's: lock / condition)
        document: list[bytes] = []  # rank 0: the metadata, read before any upload
        try:
            mine = name_shares(files, g.world, allowed=lambda name: [
                r for r, node in enumerate(self.nodes) if node in holders[name]])[g.rank]

            def upload() -> None:
                if g.rank == 0:  # the metadata of the very files uploaded (a re-save of this
                    # step moves a new copy in place: its files have other names)
                    with open(tier.file_path(step, _format.METADATA_FILE), "rb") as fh:
                        document.append(fh.read())
                    idx = _format.read_index(tier.step_dir(step), all_files=False,
                                             document=document[0])
                    if dict(idx.files) != files:
                        raise _SavedAgain(saved_again)
                states.append(store.begin(step, g.rank == 0))
                try:
                    for name in mine:
                        store.put_file(step, tier.file_path(step, name))
                except FileNotFoundError:  # the old copy's file went with the move
                    if self._saved_again(step, files):
                        raise _SavedAgain(saved_again) from None
                    raise

            # Rank 0 claims a fresh tier for the job first; every rank's begin() then finds the
            # marker (claims made at once by every rank collide on the marker's lock).
            agree(store.check_job, g, ranks="root", what=f"checking the job of {store.url}")
            saved_again = (f"fast-tier step {step} ({tier.step_dir(step)}) was saved again "
                           "while its earlier copy was being persisted; the new copy is "
                           "persisted instead")
            agree(upload, g, what=f"persisting step {step} to {store.url}")

            def commit() -> None:
                store.commit(step, document[0], files, states.pop())
                self._retain_durable()

            agree(commit, g, ranks="root", what=f"committing step {step} to {store.url}")
            self.last_persisted = step
            return step
        finally:
            for state in states:
                state.end()
