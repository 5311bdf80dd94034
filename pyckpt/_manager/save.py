"""The background work of :meth:`pyckpt.CheckpointManager.save`: the fast-tier save (agree,
write, replicate, check the copies, mark, retain) and the durable-only save; the fast tier's
budget check before staging."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from pyckpt import _format, _savedrive
from pyckpt._collective import agree, all_gather
from pyckpt._manager.groups import peer_typed
from pyckpt._manager.info import SaveInfo
from pyckpt._manager.persist import Persistence
from pyckpt._replicate import node_order, replicate, ring_targets
from pyckpt._tensors import local_view
from pyckpt._tier_io import LocalTier
from pyckpt.errors import PyckptError, StepMismatchError, TierBudgetError
from pyckpt.planner import SavePlanner

__all__ = ["Saving"]


def _state_bytes(state: Any) -> int:
    """Bytes of the tensors ``state`` holds in this process (an upper bound on what this rank
    writes: stored chunks are never larger than raw, and replicated tensors are split)."""
    from torch.utils._pytree import tree_flatten

    total = 0
    for leaf in tree_flatten(state)[0]:
        if isinstance(leaf, torch.Tensor):
            t = local_view(leaf)
            total += t.numel() * t.element_size()
    return total


def _check_steps(steps: Sequence[int]) -> None:
    """Raises StepMismatchError (the same on every rank: ``steps`` is every rank's step, as
    gathered) when the ranks passed different steps to one save."""
    if len(set(steps)) <= 1:
        return
    by_step: dict[int, list[int]] = {}
    for r, s in enumerate(steps):
        by_step.setdefault(s, []).append(r)
    said = "; ".join(f"step {s} on rank{'s' if len(rs) > 1 else ''} "
                     f"{', '.join(map(str, rs))}" for s, rs in sorted(by_step.items()))
    raise StepMismatchError(
        f"the ranks passed different steps to CheckpointManager.save ({said}); nothing of this "
        "save was written or committed in any tier (every rank must save the same step)",
        dict(enumerate(steps)))


class Saving(Persistence):
    """Runs a due step's save on the save thread (fast tier, else durable tier)."""

    @peer_typed("_group", "a fast-tier save")
    def _fast_save(self, step: int, staged: Any, staging_error: BaseException | None,
                   info: SaveInfo) -> int:
        tier, g = self.tier, self._group
        assert tier is not None and self._fast_writer is not None
        t0 = time.perf_counter()

        def check() -> tuple[int, bool]:
            if staging_error is not None:
                raise staging_error
            return step, self._leader and tier.read_marker(step) is not None

        # The first exchange: staging outcomes, the step of every rank (nothing is written
        # before they agree), and whether some node already holds this step complete.
        _, seen = agree(check, g, what=f"staging the state for fast-tier step {step}")
        _check_steps([s for s, _ in seen])
        resave = any(done for _, done in seen)
        # A step complete somewhere is saved again aside and moved in place at the commit.
        work = tier.resave_tier() if resave else tier
        agree(lambda: work.prepare(step) if self._leader else None, g,
              what=f"preparing fast-tier step {step}")
        path = work.ensure(step)  # the node's leader made it: this only checks
        self._fast_writer.reset(path)
        _savedrive.save(staged, self._fast_writer,
                        SavePlanner(check_replicas=self.check_replicas),  # type: ignore[arg-type]
                        g)
        info.write_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        index = _format.read_index(path, all_files=False)
        own = [(n, os.path.join(path, n)) for n in sorted(index.local_files)
               if _format.data_file_rank(n) == g.rank]
        stats = replicate(g, work, step, own, self.nodes, self.replicas,
                          self.replication_window_bytes)
        info.bytes_sent, info.bytes_received = stats.bytes_sent, stats.bytes_received
        holders = self._confirm_copies(step, index, work)
        record = {"save_id": index.save_id, "replicas": self.replicas,
                  "nodes": node_order(self.nodes), "holders": holders}

        def commit() -> list[int] | None:
            if not self._leader:
                return None
            work.write_marker(step, record)
            if resave:
                tier.replace(step, work)
            return [s for s in tier.steps() if tier.read_marker(s) is not None]

        _, marked = agree(commit, g, what=f"committing fast-tier step {step}")
        info.replication_s = time.perf_counter() - t1
        if step % self.persist_every == 0:
            self._queue_persist(step, dict(index.files), holders)
        agree(lambda: self._retain_local(step, [m for m in marked if m is not None])
              if self._leader else None, g, what="deleting old fast-tier steps")
        info.footprint_bytes = tier.footprint()
        self.last_save = info
        return step

    def _confirm_copies(self, step: int, index: _format.CheckpointIndex,
                        work: LocalTier) -> dict[str, list[str]]:
        """Every data file of ``step`` held by ``1 + replicas`` nodes (one all-gather), else a
        PyckptError on every rank; returns file -> nodes holding it."""
        view = work.view(step)
        gathered = all_gather((view.save_id, view.present), self._group)
        holders: dict[str, set[str]] = {n: set() for n in index.files}
        for r, (_, present) in enumerate(gathered):
            for n in present:
                if n in holders:
                    holders[n].add(self.nodes[r])
        short = sorted(n for n, h in holders.items() if len(h) < 1 + self.replicas)
        others = sorted({sid for sid, _ in gathered if sid != index.save_id}, key=str)
        if short or others:
            raise PyckptError(
                f"fast-tier step {step} ({work.step_dir(step)}) is not complete: "
                + (f"data files with fewer than {1 + self.replicas} copies: {short}; "
                   if short else "")
                + (f"nodes holding metadata of other saves: {others}" if others else ""))
        return {n: sorted(h) for n, h in holders.items()}

    @peer_typed("_group", "a durable save")
    def _durable_save(self, step: int, staged: Any, staging_error: BaseException | None,
                      info: SaveInfo) -> int:
        g = self._group
        t0 = time.perf_counter()

        def staged_ok() -> int:
            if staging_error is not None:
                raise staging_error
            return step

        _, steps = agree(staged_ok, g, what=f"staging the state for step {step}")
        _check_steps(steps)  # before anything is written
        assert self._durable_writer is not None
        self._durable_writer.reset(self.store.step_location(step))
        _savedrive.save(staged, self._durable_writer,
                        SavePlanner(check_replicas=self.check_replicas),  # type: ignore[arg-type]
                        g)
        info.write_s = time.perf_counter() - t0
        agree(self._retain_durable, g, ranks="root", what="deleting old durable steps")
        self.last_persisted = step
        self.last_save = info
        return step

    def _check_budget(self, state: Any) -> None:
        if self.local_budget_bytes is None:
            return
        assert self.tier is not None
        g = self._group
        mine = _state_bytes(state)
        footprint = self.tier.footprint() if self._leader else 0
        gathered = all_gather((mine, footprint), g)
        targets = ring_targets(self.nodes, self.replicas)
        projected: dict[str, int] = {n: 0 for n in targets}
        for r, (nbytes, fp) in enumerate(gathered):
            node = self.nodes[r]
            projected[node] += nbytes + fp
            for t in targets[node]:
                projected[t] += nbytes
        for node in node_order(self.nodes):
            if projected[node] > self.local_budget_bytes:
                raise TierBudgetError(
                    f"saving would take the fast tier of node {node!r} ({self.tier.root}) to "
                    f"{projected[node]} bytes, over local_budget_bytes={self.local_budget_bytes}"
                    f" (its present files, its ranks' state and the replicas it keeps); nothing "
                    "was written", node, projected[node], self.local_budget_bytes)
