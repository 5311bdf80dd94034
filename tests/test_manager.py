"""pyckpt.CheckpointManager: fast tier, peer replicas, durable tier, retention, restore.

Single-process tests cover the rules (due steps, retention, budget, warnings, partial durable
fetches, failed saves); multi-rank tests run 2 "nodes" x 2 ranks, each rank in its own mount
namespace so a node's fast tier is invisible to the others (tests/_manager_workers.py), lose
nodes, pieces and processes, and check every restore bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import pyckpt
from pyckpt import _tier_io
from pyckpt._format import METADATA_FILE, data_file_rank, is_data_file
from pyckpt._tier_io import MARKER_FILE

# ----------------------------------------------------------------------------- one process


def _state(step: int, zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    sd = {
        "w": torch.randn(300, 17, generator=g),
        "b": torch.randn(999, generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 20, (77,), generator=g),
        "meta": {"step": step},
    }
    if zeros:
        sd = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1})
              for k, v in sd.items()}
    return sd


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            if v.dtype != b[k].dtype or not torch.equal(v.view(torch.uint8), b[k].view(torch.uint8)):
                return False
        elif v != b[k]:
            return False
    return True


def _mgr(tmp: Path, **kw: Any) -> pyckpt.CheckpointManager:
    args: dict[str, Any] = dict(local=tmp / "local", replicas=0, save_every=2, persist_every=4,
                                keep_local=2, keep_durable=2, fsync=False)
    args.update(kw)
    return pyckpt.CheckpointManager(args.pop("durable", tmp / "durable"), **args)


def _marked(tmp: Path) -> list[int]:
    d = tmp / "local"
    return sorted(int(p.name[5:]) for p in d.iterdir() if (p / MARKER_FILE).is_file())


def _committed(tmp: Path) -> list[int]:
    d = tmp / "durable"
    return sorted(int(p.name[5:]) for p in d.iterdir()
                  if p.name.startswith("step-") and (p / METADATA_FILE).is_file())


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its path -> (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def _train(mgr: pyckpt.CheckpointManager, steps: range) -> list[int]:
    saved = []
    for s in steps:
        fut = mgr.save(s, _state(s))
        if fut is not None:
            saved.append(fut.result(timeout=120))
            if s % mgr.persist_every == 0:
                # Every due step reaches the durable tier: saves never wait for it, and a
                # persistence still running when the next is due would be superseded (tested
                # on its own) on a slow or loaded machine.
                mgr.wait()
    mgr.wait()
    return saved


def test_due_steps_retention_and_restore_from_the_fast_tier(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        assert _train(mgr, range(10)) == [0, 2, 4, 6, 8]
        assert _marked(tmp_path) == [6, 8]  # keep_local=2
        assert _committed(tmp_path) == [4, 8]  # persisted 0, 4, 8; keep_durable=2
        assert mgr.steps() == {"local": [6, 8], "durable": [4, 8]}
        assert mgr.footprint() == sum(
            f.stat().st_size for f in (tmp_path / "local").rglob("*") if f.is_file())
        assert mgr.last_save is not None and mgr.last_save.step == 8
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == 8
        assert _same(sd, _state(8))
        info = mgr.last_restore
        assert info is not None and info.tier == "fast" and info.bytes_durable == 0
        assert info.bytes_local > 0 and info.bytes_peer == 0
        assert mgr.store.data_bytes_read == 0
    # A durable step is a plain pyckpt checkpoint.
    sd = _state(0, zeros=True)
    pyckpt.load(sd, tmp_path / "durable" / "step-8")
    assert _same(sd, _state(8))


def test_empty_fast_tier_restores_from_durable_with_a_warning(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        _train(mgr, range(10))
    shutil.rmtree(tmp_path / "local")  # a full restart on new machines
    with _mgr(tmp_path) as mgr:
        sd = _state(0, zeros=True)
        with pytest.warns(pyckpt.TierWarning, match=r"step 8 .*fast tier is empty"):
            assert mgr.restore(sd) == 8
        assert _same(sd, _state(8))
        assert mgr.last_restore is not None and mgr.last_restore.tier == "durable"
        assert mgr.last_restore.bytes_durable == mgr.store.data_bytes_read > 0


def test_newest_step_without_marker_falls_back_with_the_reason(tmp_path: Path) -> None:
    with _mgr(tmp_path, persist_every=2) as mgr:
        _train(mgr, range(10))
    (tmp_path / "local" / "step-8" / MARKER_FILE).unlink()
    with _mgr(tmp_path, persist_every=2) as mgr:
        sd = _state(0, zeros=True)
        with pytest.warns(pyckpt.TierWarning, match=r"step 8 .*no completion marker"):
            assert mgr.restore(sd) == 8  # durable 8 is newer than fast-tier 6
        assert _same(sd, _state(8))


def test_a_lost_data_file_is_read_from_durable(tmp_path: Path) -> None:
    # One process writes one data file: losing it leaves nothing of step 8 in the fast tier,
    # so the step is read from the durable tier directly (the multi-node test below covers
    # fetching only the lost files while the rest comes from the nodes).
    with _mgr(tmp_path, persist_every=2) as mgr:
        _train(mgr, range(10))
    step_dir = tmp_path / "local" / "step-8"
    names = sorted(n for n in os.listdir(step_dir) if is_data_file(n))
    assert names
    lost = names[0]
    size = (step_dir / lost).stat().st_size
    (step_dir / lost).unlink()
    with _mgr(tmp_path, persist_every=2) as mgr:
        sd = _state(0, zeros=True)
        with pytest.warns(pyckpt.TierWarning, match=rf"step 8 .*{lost}.*held by no surviving"):
            assert mgr.restore(sd) == 8
        assert _same(sd, _state(8))
        assert mgr.store.direct_loads == 1 and mgr.store.data_files_fetched == 0
        assert mgr.store.data_bytes_read == size
        assert mgr.last_restore is not None and mgr.last_restore.bytes_durable == size


def _damage(path: Path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("persisted", [True, False])
def test_a_damaged_fast_tier_file_is_set_aside_for_the_next_good_source(
    tmp_path: Path, how: str, persisted: bool
) -> None:
    # One node, no replica: a damaged data file of step 8 leaves the durable copy of step 8
    # (only that file is fetched) or, when step 8 was not persisted, the older fast step 6.
    kw: dict[str, Any] = {"persist_every": 4 if persisted else 100}
    with _mgr(tmp_path, **kw) as mgr:
        _train(mgr, range(10))
    step_dir = tmp_path / "local" / "step-8"
    name = sorted(n for n in os.listdir(step_dir) if is_data_file(n))[0]
    _damage(step_dir / name, how)
    with _mgr(tmp_path, **kw) as mgr:
        sd = _state(0, zeros=True)
        with pytest.warns(pyckpt.TierWarning) as caught:
            got = mgr.restore(sd)
        assert got == (8 if persisted else 6)
        assert _same(sd, _state(got))
        text = " | ".join(str(w.message) for w in caught)
        assert f"{step_dir / name} is damaged" in text and "node " in text, text
        if persisted:  # set aside, not deleted (a restore of step 6 drops step 8 as newer)
            assert (step_dir / f"{name}.damaged").is_file()
        info = mgr.last_restore
        assert info is not None and any(name in s for s in info.skipped), info
        if persisted:
            # (one process writes one data file: none of step 8 is left, read directly)
            assert info.tier == "durable" and mgr.store.direct_loads == 1
        else:
            assert info.tier == "fast" and mgr.store.data_bytes_read == 0
    with _mgr(tmp_path, **kw) as mgr, warnings.catch_warnings():  # the next restart too
        warnings.simplefilter("ignore", pyckpt.TierWarning)
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == got and _same(sd, _state(got))


def test_a_second_job_on_one_durable_tier_is_refused(tmp_path: Path) -> None:
    with _mgr(tmp_path, job="A") as a:
        _train(a, range(10))
    assert (tmp_path / "durable" / _tier_io.JOB_DIR / METADATA_FILE).is_file()
    before = _committed(tmp_path)
    assert before == [4, 8]
    files = _tree(tmp_path / "durable")
    # Job B, its own fast tier, the same durable tier: its restore never returns A's step 8...
    for job in ("B", None):
        with _mgr(tmp_path, local=tmp_path / f"local-{job}", job=job) as b:
            with pytest.raises(pyckpt.JobMismatchError, match="job 'A'") as ei:
                b.restore(_state(0, zeros=True))
            assert ei.value.owner == "A" and ei.value.job == job
            assert ei.value.location == str(tmp_path / "durable")
    # ...and its persistence writes nothing there (its retention would delete A's steps).
    b = _mgr(tmp_path, local=tmp_path / "local-b", job="B")
    try:
        with pytest.raises(pyckpt.JobMismatchError, match="'A'.*'B'"):
            for s in range(10):
                b.save(s, _state(100 + s))
            b.wait()
    finally:
        with contextlib.suppress(pyckpt.JobMismatchError):
            b.close()
    assert _committed(tmp_path) == before
    assert _tree(tmp_path / "durable") == files  # not a file added, changed or removed
    with pytest.raises(pyckpt.JobMismatchError, match="job 'A'"):  # durable only: at once
        pyckpt.CheckpointManager(tmp_path / "durable", job="B", fsync=False)
    # Job A restarts (on new machines) and gets its own step back.
    shutil.rmtree(tmp_path / "local")
    with _mgr(tmp_path, job="A") as a:
        sd = _state(0, zeros=True)
        with pytest.warns(pyckpt.TierWarning, match="step 8"):
            assert a.restore(sd) == 8
        assert _same(sd, _state(8))


def test_a_second_job_on_one_fast_tier_is_refused(tmp_path: Path) -> None:
    """Job A leaves steps in the fast tier (the same ``local`` on the node, e.g.
    /dev/shm/pyckpt) and job B, with a durable tier of its own, starts there: B must not
    restore A's step as its own nor delete A's steps (before: B's restore returned A's step 8,
    and B's retention then deleted B's own steps while A's newer ones stayed)."""
    with _mgr(tmp_path, job="A") as a:
        _train(a, range(10))
    assert _marked(tmp_path) == [6, 8]
    files = _tree(tmp_path / "local")
    for job in ("B", None):
        with pytest.raises(pyckpt.JobMismatchError, match="fast tier .*job 'A'") as ei:
            b = _mgr(tmp_path, job=job, durable=tmp_path / f"durable-{job}")
            b.restore(_state(0, zeros=True))  # before: A's step 8, as B's own
        assert ei.value.owner == "A" and ei.value.job == job
        assert ei.value.location == str(tmp_path / "local")
    assert _tree(tmp_path / "local") == files  # not a file added, changed or removed
    with _mgr(tmp_path, job="A") as a:  # A restarts and gets its own step back
        sd = _state(0, zeros=True)
        assert a.restore(sd) == 8 and _same(sd, _state(8))
    # A fast tier no named job claimed (written by an unnamed job) is used as it is.
    with _mgr(tmp_path, local=tmp_path / "local-c", job=None,
              durable=tmp_path / "durable-c0") as c:
        _train(c, range(4))
    with _mgr(tmp_path, local=tmp_path / "local-c", job="C",
              durable=tmp_path / "durable-c") as c:
        sd = _state(0, zeros=True)
        assert c.restore(sd) == 2 and _same(sd, _state(2))


def _claim_at_first_persistence(rank: int, world: int, root: str) -> dict[str, Any]:
    """A named job's first persistence on a fresh durable tier, no restore before it; writing
    the job marker takes a while (a slow file system), so the ranks' claims overlap."""
    import time

    from pyckpt.backends import posix

    real = posix.PosixBackend.put_metadata

    def slow(self: Any, document: bytes, state: Any) -> Any:
        if self.path.endswith(_tier_io.JOB_DIR):
            time.sleep(1.0)
        return real(self, document, state)

    posix.PosixBackend.put_metadata = slow  # type: ignore[method-assign]
    mgr = pyckpt.CheckpointManager(os.path.join(root, "durable"), job="J", replicas=0,
                                   local=os.path.join(root, "local-{node}"), node=str(rank),
                                   save_every=1, persist_every=1, fsync=False)
    errors = []
    for step in (1, 2):
        try:
            mgr.save(step, {"w": torch.full((8,), float(step))})
            mgr.wait()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    mgr.close()
    return {"errors": errors, "persisted": mgr.last_persisted}


@pytest.mark.distributed
def test_a_named_jobs_first_persistence_on_several_ranks_claims_the_tier_once(
    tmp_path: Path,
) -> None:
    """Every rank checked the job of the durable tier as it began uploading: on a fresh tier
    the ranks all tried to claim it, and the loser's BlockingIOError (the marker's directory
    locked by the other) failed the first persistence (before: "another save into
    .../pyckpt-job is in progress"; the next save raised it and saved nothing)."""
    from dist_utils import run_distributed

    for res in run_distributed(_claim_at_first_persistence, 2, str(tmp_path)):
        assert res == {"errors": [], "persisted": 2}, res
    assert _committed(tmp_path) == [1, 2]
    assert _tier_io.DurableTier(tmp_path / "durable").read_job() == "J"


def test_budget_refuses_a_save_before_writing(tmp_path: Path) -> None:
    with _mgr(tmp_path, local_budget_bytes=10_000) as mgr:
        with pytest.raises(pyckpt.TierBudgetError, match="over local_budget_bytes=10000") as ei:
            mgr.save(0, _state(0))
        assert ei.value.projected > ei.value.budget == 10_000
        assert not (tmp_path / "local" / "step-0").exists()
        assert mgr.footprint() == 0
    with _mgr(tmp_path, local_budget_bytes=1 << 20) as mgr:
        _train(mgr, range(3))
        assert 0 < mgr.footprint() <= 1 << 20


def test_budget_counts_a_model_and_optimizer_given_as_objects(tmp_path: Path) -> None:
    # {"model": model, "optim": optim} is the documented form; before, the check counted only
    # the tensors it found directly in the state (none here) and wrote 7.5 MB over 100 kB.
    model = torch.nn.Linear(300, 300)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 300)).sum().backward()
    optim.step()
    with _mgr(tmp_path, local_budget_bytes=100_000) as mgr:
        with pytest.raises(pyckpt.TierBudgetError, match="over local_budget_bytes=100000"):
            mgr.save(0, {"model": model, "optim": optim, "step": 0})
        assert mgr.footprint() == 0


def test_failed_save_never_looks_complete_and_keeps_the_last_complete_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyckpt._manager.save as manager

    real = manager.replicate

    def failing(group: Any, tier: Any, step: int, *a: Any, **kw: Any) -> Any:
        if step == 10:
            raise OSError(28, "No space left on device (injected)")
        return real(group, tier, step, *a, **kw)

    monkeypatch.setattr(manager, "replicate", failing)
    with _mgr(tmp_path, keep_local=1) as mgr:
        _train(mgr, range(10))
        assert _marked(tmp_path) == [8]
        fut = mgr.save(10, _state(10))
        assert fut is not None
        with pytest.raises(OSError, match="injected"):
            fut.result(timeout=120)
        with pytest.raises(OSError, match="injected"):
            mgr.wait()
        assert _marked(tmp_path) == [8]  # the only complete step survives the failed one
        assert (tmp_path / "local" / "step-10" / METADATA_FILE).is_file()  # written, not marked
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == 8
        assert _same(sd, _state(8))
        assert not (tmp_path / "local" / "step-10").exists()  # dropped after the restore
        _train(mgr, range(12, 13))
        assert _marked(tmp_path) == [12]


def test_a_crash_between_the_renames_of_a_step_saved_again_restores_the_new_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 4 (the only fast-tier step, ``keep_local=1``) is saved again; the process dies
    between the two renames of the move: the old copy is set aside in ``.resave`` and the new,
    committed copy (its marker written) is not in place yet. The restore completes the move and
    returns the new copy (before: step 4 was missing from the fast tier, the restore returned
    None and the training started over)."""
    real = _tier_io.LocalTier.replace

    def cut(self: Any, step: int, work: Any) -> None:
        os.rename(self.step_dir(step), os.path.join(work.root, f"old-step-{step}"))
        raise SystemError("killed between the renames (injected)")

    with _mgr(tmp_path, keep_local=1, persist_every=100) as mgr:
        mgr.save(4, _state(4)).result(timeout=120)
        monkeypatch.setattr(_tier_io.LocalTier, "replace", cut)
        with pytest.raises(SystemError, match="injected"):
            mgr.save(4, _state(104)).result(timeout=120)
        with contextlib.suppress(SystemError):
            mgr.wait()
    monkeypatch.setattr(_tier_io.LocalTier, "replace", real)
    assert not (tmp_path / "local" / "step-4").exists()
    shutil.copytree(tmp_path / "local", tmp_path / "local-copy")
    with _mgr(tmp_path, keep_local=1, persist_every=100) as mgr:
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == 4
        assert _same(sd, _state(104))
        assert os.listdir(tmp_path / "local" / ".resave") == []
    # Started over without a restore, the training saves step 4 afresh: the copy left aside is
    # no longer the step's newest save, and a later restore returns the new save.
    shutil.rmtree(tmp_path / "local")
    shutil.move(tmp_path / "local-copy", tmp_path / "local")
    with _mgr(tmp_path, keep_local=1, persist_every=100) as mgr:
        mgr.save(4, _state(204)).result(timeout=120)
    with _mgr(tmp_path, keep_local=1, persist_every=100) as mgr:
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == 4
        assert _same(sd, _state(204))


def test_failed_persistence_commits_nothing(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _tier_io.DurableTier.put_file

    def put_file(self: Any, step: int, src: str) -> int:
        calls.append(step)
        if step == 8:
            raise OSError(5, "I/O error (injected)")
        return real(self, step, src)

    monkeypatch.setattr(_tier_io.DurableTier, "put_file", put_file)
    with _mgr(tmp_path) as mgr:
        for s in range(10):
            mgr.save(s, _state(s))
        with pytest.raises(OSError, match="injected"):
            mgr.wait()
        assert 8 in calls
        assert _committed(tmp_path) == [0, 4]
        assert not (tmp_path / "durable" / "step-8" / METADATA_FILE).exists()
        assert _marked(tmp_path) == [6, 8]  # the fast tier is unaffected


@pytest.mark.parametrize("when", ["uploading", "before_upload"])
def test_saving_a_step_again_while_it_is_persisted_persists_the_new_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Step 4 is saved again while its first copy is being persisted: the new copy moves in
    place under the persistence. The persistence of the old copy is superseded (a TierWarning),
    the new copy is persisted, and no save or wait raises (before: FileNotFoundError of the
    old copy's file, or "saved again before it was persisted", raised by the next save, which
    then saved nothing)."""
    import threading

    replaced = threading.Event()
    real_replace, real_put = _tier_io.LocalTier.replace, _tier_io.DurableTier.put_file
    from pyckpt._manager import persist

    real_shares = persist.name_shares

    def replace(self: Any, step: int, work: Any) -> None:
        real_replace(self, step, work)
        replaced.set()

    def put_file(self: Any, step: int, src: str) -> int:
        if when == "uploading" and step == 4 and not replaced.is_set():
            assert replaced.wait(60)
        return int(real_put(self, step, src))

    def name_shares(*args: Any, **kw: Any) -> Any:  # the persistence starts after the move
        if when == "before_upload" and not replaced.is_set():
            assert replaced.wait(60)
        return real_shares(*args, **kw)

    monkeypatch.setattr(_tier_io.LocalTier, "replace", replace)
    monkeypatch.setattr(_tier_io.DurableTier, "put_file", put_file)
    monkeypatch.setattr(persist, "name_shares", name_shares)
    with _mgr(tmp_path, save_every=1) as mgr:
        mgr.save(3, _state(3)).result(timeout=120)
        mgr.save(4, _state(4)).result(timeout=120)  # its persistence starts
        with pytest.warns(pyckpt.TierWarning, match="step 4 .*saved again"):
            mgr.save(4, _state(104)).result(timeout=120)
            mgr.save(5, _state(5)).result(timeout=120)
            mgr.wait()
        assert mgr.last_persisted == 4
    sd = _state(0, zeros=True)
    pyckpt.load(sd, tmp_path / "durable" / "step-4")
    assert _same(sd, _state(104))


def test_every_failed_persistence_is_reported_and_names_the_step_not_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Persisting steps 2 and 4 fails (a plain file where the durable step's directory goes: a
    real ``NotADirectoryError`` of the file system; step 2's persistence is held until step
    4's save is done, so both fail before the next save): that save raises one exception
    naming both steps and that its own step was not saved; a later failure is raised by
    close(), which does not return normally."""
    import concurrent.futures
    import threading
    import time

    durable = tmp_path / "durable"
    durable.mkdir()
    for s in (2, 4, 10):
        (durable / f"step-{s}").write_bytes(b"in the way")
    gate = threading.Event()
    real_begin = _tier_io.DurableTier.begin

    def begin(self: Any, step: int, is_coordinator: bool) -> Any:
        if step == 2:
            gate.wait(60)
        return real_begin(self, step, is_coordinator)

    monkeypatch.setattr(_tier_io.DurableTier, "begin", begin)

    def save(mgr: pyckpt.CheckpointManager, s: int) -> None:
        fut = mgr.save(s, _state(s))
        assert fut is not None and fut.result(timeout=30) == s

    def persisted(mgr: pyckpt.CheckpointManager) -> None:
        assert mgr._persist_future is not None
        concurrent.futures.wait([mgr._persist_future], timeout=60)

    mgr = _mgr(tmp_path, persist_every=2, keep_durable=3)
    try:
        save(mgr, 0)
        persisted(mgr)
        save(mgr, 2)
        deadline = time.monotonic() + 30
        while mgr._in_flight != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        save(mgr, 4)  # does not wait for step 2's persistence
    finally:
        gate.set()
    persisted(mgr)
    with pytest.raises(NotADirectoryError) as ei:
        mgr.save(6, _state(6))
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "persisting step 2" in notes and "persisting step 4" in notes, notes
    assert "step 6 was not saved" in notes
    assert _marked(tmp_path) == [2, 4] and mgr.last_persisted == 0
    for s in (6, 8):
        save(mgr, s)
        persisted(mgr)
    save(mgr, 10)
    with pytest.raises(NotADirectoryError) as ei:
        mgr.close()
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "persisting step 10" in notes and "persisting step 2" not in notes, notes
    assert mgr.last_persisted == 8
    assert _committed(tmp_path) == [0, 6, 8]
    mgr.close()  # closed: raises nothing more


def test_replicas_above_the_nodes_names_the_fixes(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as ei:
        _mgr(tmp_path, replicas=1, node="host-a")
    assert str(ei.value) == (
        "replicas=1 needs at least 2 nodes; the group spans 1 (node ids ['host-a']): use "
        "replicas=0 (no copies on other nodes), or, for several processes on one machine "
        "standing for several nodes, give each its own node id with node= (e.g. "
        "node=os.environ['LOCAL_RANK']) and its own fast-tier directory with {node} in local "
        "(e.g. local='/dev/shm/pyckpt/node-{node}')")


@pytest.mark.slow
def test_a_stuck_persistence_never_holds_the_fast_tier_saves(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A real SeaweedFS frozen (SIGSTOP) while step 2 is persisted: the saves after it return
    at once and their fast-tier steps complete; step 4's persistence waits, step 6 supersedes
    it (a TierWarning names both); once the store answers again, steps 2 and 6 are durable."""
    import signal
    import time

    from _s3server import started

    srv = started("stall")
    request.addfinalizer(srv.close)
    assert srv.proc is not None
    pgid = srv.proc.pid
    kw = dict(persist_every=2, save_every=1, keep_local=2, keep_durable=3)
    mgr = pyckpt.CheckpointManager("s3://stall/run", local=tmp_path / "local", replicas=0,
                                   fsync=False, storage_options=srv.storage_options(), **kw)
    try:
        assert mgr.save(1, _state(1)).result(timeout=60) == 1  # type: ignore[union-attr]
        os.killpg(pgid, signal.SIGSTOP)
        try:
            for s in range(2, 7):
                t0 = time.monotonic()
                fut = mgr.save(s, _state(s))
                assert fut is not None and fut.result(timeout=10) == s
                assert time.monotonic() - t0 < 10
            assert mgr._in_flight == 2  # still stuck on the frozen store
            assert _marked(tmp_path)[-2:] == [5, 6]
            assert (tmp_path / "local" / "step-2" / MARKER_FILE).is_file()  # being persisted
        finally:
            os.killpg(pgid, signal.SIGCONT)
        with pytest.warns(pyckpt.TierWarning, match=r"step 4 was not persisted .*step 6 "
                                                    r"supersedes it"):
            mgr.wait()
        assert mgr.last_persisted == 6
        assert sorted(s for s, done in mgr.store.list_steps().items() if done) == [2, 6]
    finally:
        mgr.close()


def test_durable_only_manager(tmp_path: Path) -> None:
    with pyckpt.CheckpointManager(tmp_path / "durable", save_every=3, keep_durable=2,
                                  fsync=False) as mgr:
        assert mgr.save(1, _state(1)) is None
        _train(mgr, range(10))
        assert _committed(tmp_path) == [6, 9]
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == 9  # no fast tier: no warning (warnings are errors here)
        assert _same(sd, _state(9))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_a_damaged_durable_step_falls_back_to_the_next_older_one(
        tmp_path: Path, fast: bool, damage: str) -> None:
    """A durable step with a data file lost or damaged (a store that lost an object, bit rot)
    is skipped with a TierWarning for the next older complete step; every step damaged: the
    first step's error, never None (a training would start over)."""
    kw: dict[str, Any] = dict(save_every=3, persist_every=3, keep_durable=3, fsync=False)
    if fast:
        kw.update(local=tmp_path / "local", replicas=0, keep_local=1)

    def mgr() -> pyckpt.CheckpointManager:
        return pyckpt.CheckpointManager(tmp_path / "durable", **kw)

    with mgr() as m:
        _train(m, range(10))
    assert _committed(tmp_path) == [3, 6, 9]
    if fast:
        shutil.rmtree(tmp_path / "local")  # every node lost: the durable tier is all there is

    def hurt(step: int) -> None:
        files = sorted((tmp_path / "durable" / f"step-{step}").glob("*.pyckpt"))
        if damage == "missing":
            files[0].unlink()
        else:
            _damage(files[0], "flip")

    hurt(9)
    with mgr() as m:
        sd = _state(0, zeros=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert m.restore(sd) == 6
        assert _same(sd, _state(6))
        assert any("restoring durable step 9 could not be loaded" in str(w.message)
                   for w in seen)
        assert m.last_restore is not None
        assert any("durable step 9" in s for s in m.last_restore.skipped)
    hurt(6)
    hurt(3)
    error = FileNotFoundError if damage == "missing" else pyckpt.CheckpointFormatError
    with mgr() as m, warnings.catch_warnings(), pytest.raises(error, match="step-9"):
        warnings.simplefilter("ignore", pyckpt.TierWarning)
        m.restore(_state(0, zeros=True))


def test_memory_durable_tier(tmp_path: Path) -> None:
    """Any backend is a durable tier (here memory://): persistence, retention, a full restart
    restored from it with the warning, and a durable-only manager."""
    from pyckpt.backends import memory

    url = f"memory://tiers-{tmp_path.name}"

    def mgr(**kw: Any) -> pyckpt.CheckpointManager:
        args: dict[str, Any] = dict(local=tmp_path / "local", replicas=0, save_every=2,
                                    persist_every=4, keep_local=2, keep_durable=2, fsync=False)
        return pyckpt.CheckpointManager(url, **dict(args, **kw))

    try:
        with mgr() as m:
            assert m.store.url == url
            assert _train(m, range(10)) == [0, 2, 4, 6, 8]
            assert m.steps() == {"local": [6, 8], "durable": [4, 8]}
            assert m.store.list_steps() == {4: True, 8: True}
        assert f"{url}/step-0" not in memory._stores  # deleted, store and all
        sd = _state(0, zeros=True)
        pyckpt.load(sd, f"{url}/step-8")  # a durable step is a plain checkpoint
        assert _same(sd, _state(8))
        shutil.rmtree(tmp_path / "local")  # a full restart on new machines
        with mgr() as m:
            sd = _state(0, zeros=True)
            with pytest.warns(pyckpt.TierWarning, match=r"step 8 .*fast tier is empty"):
                assert m.restore(sd) == 8
            assert _same(sd, _state(8))
            assert m.store.direct_loads == 1 and m.store.data_bytes_read > 0
        with mgr(local=None, save_every=3) as m:  # durable only
            _train(m, range(10, 20))
            assert m.steps()["durable"] == [15, 18]
            sd = _state(0, zeros=True)
            assert m.restore(sd) == 18
            assert _same(sd, _state(18))
    finally:
        for name in [n for n in memory._stores if n == url or n.startswith(url + "/")]:
            memory.drop(name)


def test_nothing_to_restore(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) is None
        assert sd["meta"] == {"step": -1}


@pytest.mark.parametrize("back_to", [8, 4])  # in the fast tier; in the durable tier only
def test_a_rollback_deletes_the_newer_steps_so_a_later_restore_resumes_the_new_run(
        tmp_path: Path, back_to: int) -> None:
    with _mgr(tmp_path, keep_local=3, keep_durable=3) as mgr:
        _train(mgr, range(13))
        assert mgr.steps() == {"local": [8, 10, 12], "durable": [4, 8, 12]}
        sd = _state(0, zeros=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", pyckpt.TierWarning)  # step 4: from the durable tier
            assert mgr.restore(sd, step=back_to) == back_to
        assert _same(sd, _state(back_to))
        assert mgr.steps() == {"local": [back_to] if back_to == 8 else [],
                               "durable": [s for s in (4, 8) if s <= back_to]}
        with warnings.catch_warnings():
            warnings.simplefilter("error", pyckpt.TierWarning)  # no newer step is left
            fut = mgr.save(back_to + 2, _state(1000 + back_to))  # the new run's own state
            assert fut is not None and fut.result(timeout=120) == back_to + 2
        mgr.wait()
    with _mgr(tmp_path, keep_local=3, keep_durable=3) as mgr:  # a restart: the new run's step
        sd = _state(0, zeros=True)
        assert mgr.restore(sd) == back_to + 2
        assert _same(sd, _state(1000 + back_to))


def test_a_rollback_to_a_step_no_tier_holds_deletes_nothing(tmp_path: Path) -> None:
    with _mgr(tmp_path) as mgr:
        _train(mgr, range(9))
        before = _tree(tmp_path)
        with pytest.raises(FileNotFoundError, match="step 5 is complete in no tier"):
            mgr.restore(_state(0, zeros=True), step=5)
        assert _tree(tmp_path) == before


def test_saving_below_the_steps_of_an_earlier_run_warns(tmp_path: Path) -> None:
    """A run restarted from an older step without restore(step=...) (loaded by hand, say):
    restore() would return the earlier run's newer steps; the save says so."""
    with _mgr(tmp_path) as mgr:
        _train(mgr, range(9))
    with _mgr(tmp_path) as mgr:
        with pytest.warns(pyckpt.TierWarning, match=r"holds newer steps \[6, 8\]"):
            fut = mgr.save(4, _state(104))
        assert fut is not None and fut.result(timeout=120) == 4
        mgr.wait()


@pytest.mark.parametrize("kw", [{"replicas": 1}, {"keep_local": 0}, {"save_every": 0},
                                {"replicas": -1}, {"local_budget_bytes": -1}])
def test_invalid_arguments(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _mgr(tmp_path, **kw)


def test_node_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyckpt.manager import node_identity

    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_identity() == "3"
    assert node_identity("rack1-host7") == "rack1-host7"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    import socket

    assert node_identity() == socket.gethostname()


def test_local_path_with_the_node_id(tmp_path: Path) -> None:
    with _mgr(tmp_path, local=tmp_path / "fast" / "node-{node}", node="a") as mgr:
        assert mgr.tier is not None and mgr.tier.root == str(tmp_path / "fast" / "node-a")
        assert _train(mgr, range(3)) == [0, 2]
    assert (tmp_path / "fast" / "node-a" / "step-2" / MARKER_FILE).is_file()
    for bad in ("x/y", ".."):
        with pytest.raises(ValueError, match="cannot be part of a path"):
            _mgr(tmp_path, local=tmp_path / "node-{node}", node=bad)


def test_groups_are_freed_with_the_default_group(tmp_path: Path) -> None:
    """The manager's own gloo groups are reused while the default group lives, and freed by
    ``destroy_process_group`` (once the job holds no manager): none lives on until the
    interpreter finalizes, where tearing down a gloo group can abort a process whose work is
    done (seen as "terminate called without an active exception" at a rank's exit)."""
    import gc
    import weakref
    from datetime import timedelta

    import torch.distributed as dist
    from _ports import free_port

    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with _mgr(tmp_path) as mgr:
            groups = [mgr._group.pg, mgr._persist_group.pg]
            assert _train(mgr, range(3)) == [0, 2]
        with _mgr(tmp_path) as again:  # a later manager reuses them
            assert [again._group.pg, again._persist_group.pg] == groups
        refs = [weakref.ref(g) for g in groups]
        del mgr, again, groups
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_ring_never_places_a_replica_on_its_own_node() -> None:
    from pyckpt._replicate import partners, ring_targets

    nodes = ["0", "0", "1", "1", "2", "2", "10", "10"]
    t = ring_targets(nodes, 2)
    assert t == {"0": ["1", "2"], "1": ["2", "10"], "2": ["10", "0"], "10": ["0", "1"]}
    for r in range(len(nodes)):
        assert all(nodes[p] != nodes[r] for p in partners(nodes, r, 3))
    assert partners(["a", "b", "b"], 0, 1) == [1]
    assert partners(["a", "a", "b"], 1, 1) == [2]
    with pytest.raises(ValueError, match="at least 3 nodes"):
        ring_targets(["a", "b"], 2)


# ----------------------------------------------------------------------------- several nodes

from _manager_workers import launch, log_of, namespace_refusal, result  # noqa: E402

_REFUSAL = namespace_refusal()
NNODES, PER_NODE = 2, 2
WORLD = NNODES * PER_NODE


def _run(root: Path, tag: str, action: str, *, ok: bool = True, **spec: Any) -> list[int]:
    spec = dict({"namespace": _REFUSAL is None}, **spec, tag=tag, action=action)
    codes = launch(str(root), NNODES, PER_NODE, spec)
    if ok:
        assert codes == [0] * WORLD, "\n".join(
            f"rank {r} (exit {c}):\n{log_of(str(root), tag, r)}" for r, c in enumerate(codes))
    return codes


def _node_dir(root: Path, k: int, step: int) -> Path:
    return root / "nodes" / f"n{k}" / f"step-{step}"


def _files(d: Path) -> set[str]:
    return {n for n in os.listdir(d) if is_data_file(n)} if d.is_dir() else set()


_FAST = {"replicas": 1, "save_every": 1, "persist_every": 2, "keep_local": 2,
         "keep_durable": 2, "fsync": False}

multinode = pytest.mark.distributed


@multinode
def test_lose_one_node_restores_bit_exact_from_replicas_with_zero_durable_reads(
    tmp_path: Path,
) -> None:
    _run(tmp_path, "train", "train", steps=[1, 2, 3], manager=_FAST)
    r0 = result(str(tmp_path), "train", 0)
    if _REFUSAL is None:
        assert r0["visible_nodes"] == []  # other nodes' fast tiers are unreachable
    for k in range(NNODES):
        assert sorted(int(p.name[5:]) for p in (tmp_path / "nodes" / f"n{k}").iterdir()) == [2, 3]
        d = _node_dir(tmp_path, k, 3)
        assert (d / MARKER_FILE).is_file()
        writers = {data_file_rank(n) // PER_NODE for n in _files(d)}
        assert writers == {0, 1}  # its own ranks' files and the other node's replicas
    assert sorted(p.name for p in (tmp_path / "durable").iterdir()) == ["step-2"]
    for r in range(WORLD):
        info = result(str(tmp_path), "train", r)["last_save"]
        assert info["bytes_sent"] > 0 and info["bytes_received"] > 0
    # Lose node 1 (its processes ended; its fast tier is gone). Remove the durable data too:
    # a read from the durable tier would then fail.
    shutil.rmtree(tmp_path / "nodes" / "n1")
    for f in (tmp_path / "durable").rglob("*.pyckpt"):
        f.unlink()
    _run(tmp_path, "restore", "restore", manager=_FAST, restore_again=True)
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 3 and res["bad"] == [], res
        # a second restore of the same layout runs on the cached load plan (pyckpt._loaddrive)
        assert res["step_again"] == 3 and res["bad_again"] == [], res
        assert res["restore_again"] == ["cached"], res
        assert res["warnings"] == []
        assert res["durable_data_bytes_read"] == 0 and res["durable_data_files_fetched"] == 0
        assert res["durable_direct_loads"] == 0
        assert res["durable_metadata_reads"] == 0
        info = res["info"]
        assert info["tier"] == "fast" and info["bytes_durable"] == 0
        if r // PER_NODE == 1:  # the new node 1 had nothing: every byte came from node 0
            assert info["bytes_local"] == 0 and info["bytes_peer"] > 0, res
        else:
            assert info["bytes_peer"] == 0 and info["bytes_local"] > 0, res


@pytest.mark.slow
@multinode
def test_nodes_sharing_a_file_system_lose_one_node_with_local_per_node(tmp_path: Path) -> None:
    # No mount namespaces: every rank is given local=<root>/nodes/n{node} and the manager puts
    # its node id in the path (several "nodes" on one machine, as in examples/train.py).
    spec = {"manager": _FAST, "local_per_node": True, "namespace": False}
    _run(tmp_path, "train", "train", steps=[1, 2, 3], **spec)
    for k in range(NNODES):
        d = _node_dir(tmp_path, k, 3)
        assert (d / MARKER_FILE).is_file()
        assert {data_file_rank(n) // PER_NODE for n in _files(d)} == {0, 1}
    shutil.rmtree(tmp_path / "nodes" / "n1")
    for f in (tmp_path / "durable").rglob("*.pyckpt"):
        f.unlink()  # a read from the durable tier would fail
    _run(tmp_path, "restore", "restore", **spec)
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 3 and res["bad"] == [] and res["warnings"] == [], res
        info = res["info"]
        assert info["tier"] == "fast" and info["bytes_durable"] == 0
        assert res["durable_data_bytes_read"] == 0 and res["durable_direct_loads"] == 0
        if r // PER_NODE == 1:
            assert info["bytes_local"] == 0 and info["bytes_peer"] > 0, res
        else:
            assert info["bytes_peer"] == 0 and info["bytes_local"] > 0, res


@pytest.mark.slow
@multinode
def test_damaged_fast_tier_copies_are_skipped_for_the_replica(tmp_path: Path) -> None:
    # Node 0's own copy of rank 0's file of step 3 has a flipped byte, and node 1's
    # pyckpt.json of step 3 is garbage: the restore reads rank 0's file from node 1's replica
    # and node 1 uses node 0's metadata, bit-exact, with warnings naming both copies. (Durable
    # step 3 does not exist: persist_every=2.)
    spec = {"manager": _FAST, "local_per_node": True, "namespace": False}
    _run(tmp_path, "train", "train", steps=[1, 2, 3], **spec)
    own = sorted(n for n in _files(_node_dir(tmp_path, 0, 3)) if data_file_rank(n) == 0)
    assert len(own) == 1 and own[0] in _files(_node_dir(tmp_path, 1, 3))  # replicated
    _damage(_node_dir(tmp_path, 0, 3) / own[0], "flip")
    (_node_dir(tmp_path, 1, 3) / METADATA_FILE).write_bytes(b"{not json")
    _run(tmp_path, "restore", "restore", **spec)
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 3 and res["bad"] == [] and res["info"]["tier"] == "fast", res
        text = " | ".join(m for _, m in res["warnings"])
        assert {w[0] for w in res["warnings"]} == {"TierWarning"}, res["warnings"]
        assert f"{_node_dir(tmp_path, 0, 3) / own[0]} is damaged" in text, text
        assert f"{_node_dir(tmp_path, 1, 3) / METADATA_FILE} is damaged" in text, text
        assert res["durable_data_bytes_read"] == 0
    assert (_node_dir(tmp_path, 0, 3) / f"{own[0]}.damaged").is_file()
    assert (_node_dir(tmp_path, 1, 3) / f"{METADATA_FILE}.damaged").is_file()


@pytest.mark.slow
@multinode
def test_a_full_disk_while_receiving_a_replica_names_the_file_node_and_step(
    tmp_path: Path,
) -> None:
    # Node 1's fast tier is a tmpfs with room for its own rank's files but not for the
    # replica of node 0's: the error keeps its errno and names the file, the node and the step.
    import subprocess

    from _manager_workers import launch

    if _REFUSAL is not None:
        pytest.skip(_REFUSAL)
    n1 = tmp_path / "nodes" / "n1"
    n1.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(n1)], check=True)
    try:
        spec = {"manager": dict(_FAST, persist_every=100), "local_per_node": True,
                "namespace": False, "record_error": True, "tag": "train", "action": "train",
                "steps": [1]}
        codes = launch(str(tmp_path), 2, 1, spec)
        assert codes == [0, 0], [log_of(str(tmp_path), "train", r) for r in range(2)]
        errors = [result(str(tmp_path), "train", r).get("error") for r in range(2)]
    finally:
        subprocess.run(["umount", "-l", str(n1)], check=False)
    mine = errors[1]
    assert mine is not None and mine["type"] == "OSError" and mine["errno"] == 28, errors
    assert mine["filename"].startswith(str(n1 / "step-1") + os.sep), mine
    assert "step 1" in mine["text"] and "node '1'" in mine["text"] and "rank 0" in mine["text"]
    assert errors[0] is not None and errors[0]["errno"] == 28, errors  # raised on every rank


def _s3_durable(request: pytest.FixtureRequest, kind: str) -> tuple[str | None, Any]:
    if kind == "dir":
        return None, None
    from _s3server import started

    srv = started("tiers")
    request.addfinalizer(srv.close)
    return "s3://tiers/run-1", srv.storage_options()


@pytest.mark.slow
def test_durable_tier_down_or_frozen_restores_the_fast_tier_with_a_warning(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    import signal
    import time

    from _s3server import started

    srv = started("tiers")
    request.addfinalizer(srv.close)
    kw: dict[str, Any] = {"storage_options": srv.storage_options(), "job": "A"}
    with pyckpt.CheckpointManager("s3://tiers/run-1", local=tmp_path / "local", replicas=0,
                                  save_every=2, persist_every=4, fsync=False, **kw) as mgr:
        _train(mgr, range(10))
        assert mgr.steps() == {"local": [6, 8], "durable": [0, 4, 8]}
    for how in ("frozen", "down"):
        if how == "frozen":
            os.killpg(srv.proc.pid, signal.SIGSTOP)
        else:
            os.killpg(srv.proc.pid, signal.SIGCONT)
            srv.kill()
        with pyckpt.CheckpointManager("s3://tiers/run-1", local=tmp_path / "local", replicas=0,
                                      save_every=2, persist_every=4, fsync=False, **kw) as mgr:
            sd = _state(0, zeros=True)
            t0 = time.monotonic()
            with pytest.warns(pyckpt.TierWarning, match="could not be listed") as caught:
                assert mgr.restore(sd) == 8
            elapsed = time.monotonic() - t0
            assert _same(sd, _state(8))
            assert "s3://tiers/run-1" in str(caught[0].message)
            assert mgr.last_restore is not None and mgr.last_restore.tier == "fast"
            assert elapsed < 30, (how, elapsed)  # the listing gives up after 10 s


@pytest.mark.slow
@multinode
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_every_copy_of_a_piece_lost_falls_back_to_durable_for_that_piece(
    tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    durable, options = _s3_durable(request, kind)
    spec = {"manager": _FAST, "durable": durable, "storage_options": options}
    _run(tmp_path, "train", "train", steps=[1, 2], **spec)
    if durable is None:
        assert (tmp_path / "durable" / "step-2" / METADATA_FILE).is_file()
    # The file rank 2 wrote is lost on both nodes (its own and the replica).
    lost = sorted(n for n in _files(_node_dir(tmp_path, 1, 2)) if data_file_rank(n) == 2)
    assert len(lost) == 1
    size = (_node_dir(tmp_path, 1, 2) / lost[0]).stat().st_size
    for k in range(NNODES):
        (_node_dir(tmp_path, k, 2) / lost[0]).unlink()
    _run(tmp_path, "restore", "restore", **spec)
    total = 0
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 2 and res["bad"] == [], res
        assert [w[0] for w in res["warnings"]] == ["TierWarning"]
        assert "step 2" in res["warnings"][0][1] and lost[0] in res["warnings"][0][1]
        assert res["info"]["tier"] == "durable"
        total += res["durable_data_bytes_read"]
    assert total == size  # only the lost piece came from the durable tier


@pytest.mark.slow
@multinode
def test_crash_during_replication_never_leaves_a_complete_step(tmp_path: Path) -> None:
    spec = {"manager": dict(_FAST, persist_every=1)}
    codes = _run(tmp_path, "train", "train", ok=False, steps=[1, 2],
                 crash={"at": "replicate", "step": 2, "rank": 1}, **spec)
    assert codes[1] == 17 and codes != [0] * WORLD
    for k in range(NNODES):
        assert (_node_dir(tmp_path, k, 1) / MARKER_FILE).is_file()
        assert not (_node_dir(tmp_path, k, 2) / MARKER_FILE).exists()
    assert not (tmp_path / "durable" / "step-2" / METADATA_FILE).exists()
    _run(tmp_path, "restore", "restore", **spec)
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 1 and res["bad"] == [] and res["info"]["tier"] == "fast", res
        assert res["warnings"] == []
    for k in range(NNODES):  # the incomplete step was dropped on restore
        assert not _node_dir(tmp_path, k, 2).exists()


@pytest.mark.slow
@multinode
def test_crash_during_persistence_never_commits_the_durable_step(tmp_path: Path) -> None:
    spec = {"manager": _FAST}
    codes = _run(tmp_path, "train", "train", ok=False, steps=[1, 2, 3, 4],
                 crash={"at": "persist", "step": 4, "rank": 3}, **spec)
    assert codes[3] == 18
    assert (tmp_path / "durable" / "step-2" / METADATA_FILE).is_file()
    assert not (tmp_path / "durable" / "step-4" / METADATA_FILE).exists()
    # Every node lost: a full restart finds only the durable step 2, and says so.
    shutil.rmtree(tmp_path / "nodes")
    _run(tmp_path, "restore", "restore", **spec)
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 2 and res["bad"] == [] and res["info"]["tier"] == "durable", res
        assert [w[0] for w in res["warnings"]] == ["TierWarning"]
        assert "step 2" in res["warnings"][0][1]


def _run_pair(root: Path, tag: str, action: str, *, ok: bool = True, **spec: Any) -> list[int]:
    """Two nodes x one rank (the save-side cases need no more)."""
    spec = dict({"namespace": _REFUSAL is None}, **spec, tag=tag, action=action)
    codes = launch(str(root), 2, 1, spec, grace=20.0)
    if ok:
        assert codes == [0, 0], "\n".join(
            f"rank {r} (exit {c}):\n{log_of(str(root), tag, r)}" for r, c in enumerate(codes))
    return codes


@pytest.mark.slow
@multinode
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "durable_only"])
def test_ranks_saving_different_steps_commit_nothing(tmp_path: Path, fast: bool) -> None:
    """Rank 0 saves step 4 while rank 1 saves step 5: every rank raises StepMismatchError
    naming both, no tier holds a complete step 4 or 5, and a restore returns step 2 bit
    for bit."""
    spec = {"manager": dict(_FAST, persist_every=1), "fast": fast}
    _run_pair(tmp_path, "save", "mismatch", entry="_manager_save_workers", good=2,
              steps=[4, 5], **spec)
    for r in range(2):
        res = result(str(tmp_path), "save", r)
        assert res["future_failed"], res
        [err] = res["errors"]
        assert err["type"] == "StepMismatchError", err
        assert "step 4 on rank 0; step 5 on rank 1" in err["message"], err
        assert err["steps"] == {"0": 4, "1": 5}
    for s in (4, 5):
        assert not (tmp_path / "durable" / f"step-{s}" / METADATA_FILE).exists()
        for k in range(2):
            assert not (_node_dir(tmp_path, k, s) / MARKER_FILE).exists()
    assert (tmp_path / "durable" / "step-2" / METADATA_FILE).is_file()
    _run_pair(tmp_path, "restore", "restore", **spec)
    for r in range(2):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 2 and res["bad"] == [], res


@pytest.mark.slow
@multinode
def test_a_crash_while_saving_a_complete_step_again_keeps_the_old_copy(tmp_path: Path) -> None:
    """Step 5 is complete; saving it again, rank 1 is killed in the middle of the replication:
    the old copy of step 5 is still in place on both nodes and is restored."""
    spec = {"manager": dict(_FAST, persist_every=100)}
    _run_pair(tmp_path, "train", "train", steps=[4, 5], **spec)
    old = [_files(_node_dir(tmp_path, k, 5)) for k in range(2)]
    codes = _run_pair(tmp_path, "again", "train", ok=False, steps=[5],
                      crash={"at": "replicate", "step": 5, "rank": 1}, **spec)
    assert codes[1] == 17
    for k in range(2):
        assert (_node_dir(tmp_path, k, 5) / MARKER_FILE).is_file()
        assert _files(_node_dir(tmp_path, k, 5)) == old[k]
    _run_pair(tmp_path, "restore", "restore", **spec)
    for r in range(2):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 5 and res["bad"] == [] and res["info"]["tier"] == "fast", res
    # Saved again to completion, the new copy replaces the old one (and .resave is emptied).
    _run_pair(tmp_path, "third", "train", steps=[5, 6], **spec)
    for k in range(2):
        assert (_node_dir(tmp_path, k, 5) / MARKER_FILE).is_file()
        assert _files(_node_dir(tmp_path, k, 5)).isdisjoint(old[k])
        assert os.listdir(tmp_path / "nodes" / f"n{k}" / ".resave") == []


@pytest.mark.slow
@multinode
@pytest.mark.parametrize("aside", ["kept", "lost"])
def test_a_crash_between_the_nodes_moves_of_a_step_saved_again_restores_it(
    tmp_path: Path, aside: str
) -> None:
    """Step 5 (the only fast-tier step, ``keep_local=1``) is saved again; node 0 moves its new
    copy in, node 1's rank dies before its move: each node holds a complete save of step 5
    (its own files and the other node's replicas) under a marker of its own. With node 1's
    committed new copy still in ``.resave`` the restore completes its move (the new save on
    both nodes); with that copy lost, it takes one of the two saves, with a warning. Either is
    restored bit for bit (before: "markers of different saves", no step complete: the restore
    returned None without a warning and the training started over)."""
    spec = {"manager": dict(_FAST, keep_local=1, persist_every=100)}
    _run_pair(tmp_path, "train", "train", steps=[4, 5], **spec)
    codes = _run_pair(tmp_path, "again", "train", ok=False, steps=[5],
                      crash={"at": "replace", "step": 5, "rank": 1}, **spec)
    assert codes[1] == 19

    def marked() -> list[str]:
        return [json.loads((_node_dir(tmp_path, k, 5) / MARKER_FILE).read_bytes())["save_id"]
                for k in range(2)]

    sids = marked()
    assert sids[0] != sids[1]  # node 0 holds the new save, node 1 the old one
    for k in range(2):
        assert {data_file_rank(n) for n in _files(_node_dir(tmp_path, k, 5))} == {0, 1}
    if aside == "lost":
        shutil.rmtree(tmp_path / "nodes" / "n1" / ".resave")
    _run_pair(tmp_path, "restore", "restore", **spec)
    for r in range(2):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 5 and res["bad"] == [] and res["info"]["tier"] == "fast", res
        if aside == "kept":
            assert res["warnings"] == [], res
        else:
            assert [w[0] for w in res["warnings"]] == ["TierWarning"], res
            assert "markers of 2 saves" in res["warnings"][0][1], res
    if aside == "kept":
        assert marked() == [sids[0], sids[0]]
    _run_pair(tmp_path, "later", "train", steps=[6], **spec)  # and the training goes on
    _run_pair(tmp_path, "restore6", "restore", **spec)
    assert result(str(tmp_path), "restore6", 0)["step"] == 6


@pytest.mark.slow
@multinode
def test_a_marker_on_one_node_only_keeps_every_copy_through_retention(tmp_path: Path) -> None:
    """Step 3's completion marker reaches node 0 only (writing it on node 1 fails): every node
    keeps the same steps afterwards, so step 3 keeps both copies (before, node 1 deleted its
    copy while node 0 deleted step 2's: both steps were left with one copy each)."""
    spec = {"manager": dict(_FAST, persist_every=100)}
    _run_pair(tmp_path, "train", "partial_marker", entry="_manager_save_workers",
              steps=[1, 2, 3, 4], fail_rank=1, fail_step=3, **spec)
    for r in range(2):
        errors = result(str(tmp_path), "train", r)["errors"]
        assert [e["step"] for e in errors] == [3], errors
    assert (_node_dir(tmp_path, 0, 3) / MARKER_FILE).is_file()
    assert not (_node_dir(tmp_path, 1, 3) / MARKER_FILE).exists()
    both = _files(_node_dir(tmp_path, 0, 3))
    assert {data_file_rank(n) for n in both} == {0, 1}
    for k in range(2):
        assert sorted(int(p.name[5:]) for p in (tmp_path / "nodes" / f"n{k}").iterdir()
                      if p.name.startswith("step-")) == [3, 4]
        assert _files(_node_dir(tmp_path, k, 3)) == both


@pytest.mark.gpu
def test_gpu_state_saved_and_restored_into_cuda_tensors(tmp_path: Path) -> None:
    dev = torch.device("cuda")
    state = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in _state(4).items()}
    with _mgr(tmp_path) as mgr:
        fut = mgr.save(4, state)
        assert fut is not None
        for v in state.values():  # training goes on: the save holds its own copy
            if isinstance(v, torch.Tensor):
                v.zero_()
        assert fut.result(timeout=120) == 4
        mgr.wait()
        sd = {k: (torch.zeros_like(v, device=dev) if isinstance(v, torch.Tensor) else v)
              for k, v in _state(0, zeros=True).items()}
        assert mgr.restore(sd) == 4
        assert all(v.is_cuda for v in sd.values() if isinstance(v, torch.Tensor))
        assert _same({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()},
                     _state(4))


@multinode
@pytest.mark.gpu
def test_gpu_lose_one_node_restores_into_cuda_tensors_from_peer_replicas(tmp_path: Path) -> None:
    # The several-node test above with every tensor (DTensor shards included) on the GPU: each
    # rank's save stages device memory, and after node 1 is lost its new ranks restore into
    # CUDA tensors from node 0's replicas, with no durable reads.
    spec = {"manager": _FAST, "local_per_node": True, "namespace": False, "device": "cuda"}
    _run(tmp_path, "train", "train", steps=[1, 2, 3], **spec)
    shutil.rmtree(tmp_path / "nodes" / "n1")
    for f in (tmp_path / "durable").rglob("*.pyckpt"):
        f.unlink()
    _run(tmp_path, "restore", "restore", **spec)
    for r in range(WORLD):
        res = result(str(tmp_path), "restore", r)
        assert res["step"] == 3 and res["bad"] == [] and res["warnings"] == [], res
        assert res["devices"] == ["cuda"], res
        info = res["info"]
        assert info["tier"] == "fast" and info["bytes_durable"] == 0
        assert res["durable_data_bytes_read"] == 0 and res["durable_direct_loads"] == 0
        if r // PER_NODE == 1:
            assert info["bytes_local"] == 0 and info["bytes_peer"] > 0, res


_UNCLOSED_CHILD = """
import sys, torch, pyckpt
root = sys.argv[1]
mgr = pyckpt.CheckpointManager(root + "/durable", local=root + "/local", replicas=0,
                               save_every=1, persist_every=1, fsync=False)
mgr.save(1, {"w": torch.arange(1 << 20, dtype=torch.float32)})
# no close(), no wait(): the script ends with the fast-tier save in flight
"""


def test_a_manager_not_closed_at_exit_still_persists_its_step(tmp_path: Path) -> None:
    """The docs ask for close(); a script that forgets it (or dies of an exception past the
    save) used to lose the durable copy: the fast-tier save, completed by the interpreter's
    exit, could no longer queue its persistence ("cannot schedule new futures")."""
    import subprocess
    import sys

    from _child_env import child_env

    subprocess.run([sys.executable, "-c", _UNCLOSED_CHILD, str(tmp_path)], env=child_env(),
                   check=True, timeout=300)
    assert _committed(tmp_path) == [1]
    dest = {"w": torch.zeros(1 << 20)}
    pyckpt.load(dest, tmp_path / "durable" / "step-1")
    assert torch.equal(dest["w"], torch.arange(1 << 20, dtype=torch.float32))
