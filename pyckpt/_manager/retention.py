"""Retention of :class:`pyckpt.CheckpointManager`: which steps each tier keeps."""

from __future__ import annotations

from collections.abc import Sequence

from pyckpt._manager.base import ManagerBase

__all__ = ["Retention"]


class Retention(ManagerBase):
    """Deletes the steps a tier no longer keeps (only once a newer step is complete there)."""

    def _retain_local(self, newest: int, marked: Sequence[Sequence[int]]) -> None:
        """On this node: keeps the newest ``keep_local`` steps marked on any node (``marked``:
        each node's marked steps, the same list on every rank, so every node keeps the same
        steps and a step whose marker reached only some nodes keeps every copy), ``newest``,
        the steps pending or being persisted and any step newer than ``newest``; deletes the
        rest."""
        tier = self.tier
        assert tier is not None
        steps = tier.steps()
        complete = sorted({s for m in marked for s in m})
        keep = set(complete[-self.keep_local:]) | {newest}
        with self._pinned_lock:
            keep |= {s for s, _, _ in self._pending}
            if self._in_flight is not None:
                keep.add(self._in_flight)
        for s in steps:
            if s not in keep and s < newest:
                tier.remove(s)

    def _retain_durable(self) -> None:
        """Keeps the newest ``keep_durable`` committed durable steps; deletes older steps
        (committed or not). Steps newer than the newest committed one are left alone."""
        listed = self.store.list_steps()
        done = sorted(s for s, c in listed.items() if c)
        if not done:
            return
        keep = set(done[-self.keep_durable:])
        for s in sorted(listed):
            if s not in keep and s < done[-1]:
                self.store.remove(s)
