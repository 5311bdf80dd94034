"""A location holding checkpoints (what the checkpoint manager's tiers need), on every
backend: the checkpoints under a location are listed with whether each is committed, a stored
file is fetched whole, and a checkpoint is deleted metadata first.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
from _backend_places import Place

from pyckpt._format import METADATA_FILE
from pyckpt.backends import child_location
from pyckpt.errors import CheckpointFormatError


def _sd(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "step": seed}


def _child(place: Place, name: str) -> Place:
    return Place(place.kind, child_location(place.location, name), place.options, place.server)


def test_children_are_listed_with_their_commit_state(place: Place) -> None:
    assert place.backend().list_children() == {}  # nothing there yet
    _child(place, "step-1").save(_sd(1))
    _child(place, "step-2").save(_sd(2))
    partial = _child(place, "step-3").backend()
    partial.begin_save(False, True).end()
    with partial.data_sink("0-0.0123456789ab.pyckpt", {}) as sink:
        sink.append(b"x" * 10)  # data without metadata: a save that did not commit
        sink.commit()
    assert place.backend().list_children() == {"step-1": True, "step-2": True, "step-3": False}
    assert _child(place, "step-1").backend().list_children() == {}


def test_get_file_copies_a_stored_file_whole(place: Place, tmp_path: Path) -> None:
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    ckpt = _child(place, "c")
    ckpt.save(_sd(3))
    backend = ckpt.backend()
    names = backend.list_names()
    assert names
    for name, size in names.items():
        assert backend.get_file(name, str(tmp_path / name)) == size
        assert (tmp_path / name).stat().st_size == size
    meta = tmp_path / "meta.json"
    n = backend.get_file(METADATA_FILE, str(meta))
    assert n == meta.stat().st_size and backend.metadata_is(meta.read_bytes())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, "meta.json"])  # no temps
    missing = "0-0.00000000000f.pyckpt"
    with pytest.raises(FileNotFoundError) as info:
        backend.get_file(missing, str(tmp_path / "x"))
    assert info.value.filename == backend.url_of(missing)
    assert not (tmp_path / "x").exists()
    with pytest.raises(CheckpointFormatError, match="illegal"):
        backend.get_file("../evil", str(tmp_path / "y"))


def test_delete_checkpoint_removes_it_metadata_first(place: Place,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    keep, gone = _child(place, "step-1"), _child(place, "step-2")
    keep.save(_sd(4))
    gone.save(_sd(5))
    backend = gone.backend()
    cls = type(getattr(backend, "local", backend))  # peer: its directory's backend deletes
    real = cls.delete
    calls: list[list[str]] = []

    def failing_delete(self: Any, names: Any) -> None:  # the store fails after the first call
        calls.append(list(names))
        if len(calls) > 1:
            raise OSError(errno.EIO, "injected: I/O error", self.location)
        real(self, calls[-1])

    monkeypatch.setattr(cls, "delete", failing_delete)
    with pytest.raises(OSError, match="injected"):
        gone.backend().delete_checkpoint()
    monkeypatch.setattr(cls, "delete", real)
    # Half deleted: no longer complete (the metadata went first), its data still there.
    assert place.backend().list_children()["step-2"] is False
    assert gone.backend().list_names()
    with pytest.raises(FileNotFoundError):
        gone.backend().read_index()
    gone.backend().delete_checkpoint()
    assert place.backend().list_children() == {"step-1": True}
    gone.backend().delete_checkpoint()  # nothing there: nothing to do
    out = {"w": torch.zeros(20_000), "step": -1}
    keep.load(out)
    assert torch.equal(out["w"], _sd(4)["w"])


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_child_names_are_plain(name: str) -> None:
    with pytest.raises(ValueError, match="illegal child name"):
        child_location("memory://x", name)
