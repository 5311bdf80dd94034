"""A resume never drops stored state silently (issue: the Quickstart's state lost the optimizer).

A fresh optimizer's ``state_dict()`` has no ``state`` entries, so ``{"model": ...,
"optim": optim.state_dict()}`` asks for no Adam moment: DCP loads the rest and the resumed run
diverges. pyckpt raises (``pyckpt.load``, ``CheckpointManager.restore``) or warns (``dcp.load``
with ``pyckpt.Reader``), and the patterns the README shows resume bit-identically.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import pyckpt
from pyckpt._partial import left_behind

BATCH = torch.linspace(-1, 1, 24).reshape(6, 4)


def _make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        optim.zero_grad()
        loss = (model(BATCH) ** 2).mean()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def _trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = _make()
    _train(model, optim, steps)
    return model, optim


def _quickstart_ckpt(path: Path) -> None:
    model, optim = _trained()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.save(state, storage_writer=pyckpt.Writer(str(path), compression="zstd"))


# -- the rule ----------------------------------------------------------------------------------


def test_left_behind_groups_entries_under_keys_the_destination_holds() -> None:
    stored = ["model.w", "optim.state.0.exp_avg", "optim.state.1.step",
              "optim.param_groups.0.lr", "extra.rng"]
    fresh = ["model.w", "optim.param_groups.0.lr"]
    assert left_behind(stored, fresh) == {
        "optim.state": ["optim.state.0.exp_avg", "optim.state.1.step"]}
    # keys the destination does not hold at all: a deliberate selection
    assert left_behind(stored, ["model.w"]) == {}
    assert left_behind(stored, stored) == {}
    # a smaller model: the layer it lacks is named
    assert left_behind(["m.0.w", "m.1.w", "m.2.w"], ["m.0.w", "m.1.w"]) == {"m.2": ["m.2.w"]}


def test_a_held_top_level_key_that_asks_for_nothing_holds_the_entries_under_it() -> None:
    stored = ["model.w", "loader.pos", "extra.lr"]
    # 'loader' is held (an empty dict, a Stateful not used yet): its entry is left behind
    assert left_behind(stored, ["model.w"], ["model", "loader"]) == {"loader.pos": ["loader.pos"]}
    assert left_behind(stored, ["model.w"], ["model"]) == {}


# -- single process ----------------------------------------------------------------------------


class _Loader:
    """A Stateful data-loader position: its state_dict() is empty until the first batch."""

    def __init__(self, pos: int | None = None) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, int]:
        return {} if self.pos is None else {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd.get("pos")


def test_a_stateful_whose_state_is_still_empty_is_refused_not_skipped(tmp_path: Path) -> None:
    """A top-level key asking for nothing (a Stateful not used yet, an empty dict) would
    leave the stored entries under it unloaded: the resumed loader would restart at 0."""
    model = torch.nn.Linear(3, 2)
    pyckpt.save({"model": model, "loader": _Loader(1234), "extra": {"lr": 0.5}}, tmp_path / "ck")
    fresh = _Loader()
    with pytest.raises(pyckpt.PartialLoadError, match=r"'loader\.pos'") as info:
        pyckpt.load({"model": torch.nn.Linear(3, 2), "loader": fresh, "extra": {"lr": 0.0}},
                    tmp_path / "ck")
    assert list(info.value.unloaded) == ["loader.pos"] and fresh.pos is None
    state: dict[str, object] = {"model": {"weight": torch.zeros(2, 3)}, "extra": {}}
    with pytest.raises(pyckpt.PartialLoadError, match=r"'extra\.lr'"):
        pyckpt.load(state, tmp_path / "ck", allow_partial=False)
    with pytest.warns(pyckpt.PartialLoadWarning, match=r"'loader\.pos'"):
        dcp.load({"loader": _Loader()}, storage_reader=pyckpt.Reader(tmp_path / "ck"),
                 planner=pyckpt.LoadPlanner())
    # not held at all: a deliberate selection; used, the loader loads its position
    loader = _Loader(0)
    pyckpt.load({"model": torch.nn.Linear(3, 2), "loader": loader}, tmp_path / "ck")
    assert loader.pos == 1234


def test_pyckpt_load_of_a_fresh_optimizer_raises_and_loads_nothing(tmp_path: Path) -> None:
    _quickstart_ckpt(tmp_path / "ck")
    model, optim = _make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    with pytest.raises(pyckpt.PartialLoadError) as info:
        pyckpt.load(state, tmp_path / "ck")
    err = info.value
    assert "'optim.state'" in str(err) and "get_state_dict" in str(err)
    assert "allow_partial=True" in str(err) and str(tmp_path / "ck") in str(err)
    assert err.path == str(tmp_path / "ck")
    assert list(err.unloaded) == ["optim.state"]
    assert "optim.state.0.exp_avg" in err.unloaded["optim.state"]
    for k, v in model.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k]), k


def test_allow_partial_loads_what_was_asked(tmp_path: Path) -> None:
    _quickstart_ckpt(tmp_path / "ck")
    trained, _ = _trained()
    model, optim = _make()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyckpt.PartialLoadWarning)
        pyckpt.load(state, tmp_path / "ck", allow_partial=True)
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_loading_only_the_model_is_not_partial(tmp_path: Path) -> None:
    _quickstart_ckpt(tmp_path / "ck")
    trained, _ = _trained()
    model, _ = _make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyckpt.PartialLoadWarning)
        pyckpt.load({"model": model.state_dict()}, tmp_path / "ck")
        dcp.load({"model": model.state_dict()}, storage_reader=pyckpt.Reader(tmp_path / "ck"))
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("planner", ["dcp", "pyckpt"])
def test_dcp_load_with_pyckpt_reader_warns(tmp_path: Path, planner: str) -> None:
    _quickstart_ckpt(tmp_path / "ck")
    model, optim = _make()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    kwargs = {"planner": pyckpt.LoadPlanner()} if planner == "pyckpt" else {}
    with pytest.warns(pyckpt.PartialLoadWarning, match=r"'optim\.state'.*get_state_dict"):
        dcp.load(state, storage_reader=pyckpt.Reader(tmp_path / "ck"), **kwargs)
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=pyckpt.Reader(tmp_path / "ck", allow_partial=False))
    assert isinstance(pyckpt.find_error(info.value, pyckpt.PartialLoadError),
                      pyckpt.PartialLoadError)


def test_the_get_state_dict_pattern_resumes_bit_identically(tmp_path: Path) -> None:
    """The README's pattern: get_state_dict before save and load, set_state_dict after."""
    model, optim = _make()
    expected = _train(model, optim, 6)

    model, optim = _make()
    _train(model, optim, 3)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd},
             storage_writer=pyckpt.Writer(tmp_path / "ck", compression="zstd"))

    model, optim = _make()  # a new process's objects
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyckpt.PartialLoadWarning)
        dcp.load(state, storage_reader=pyckpt.Reader(tmp_path / "ck"))
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    assert _train(model, optim, 3) == expected[3:]


def test_modules_and_optimizers_resume_bit_identically(tmp_path: Path) -> None:
    model, optim = _make()
    expected = _train(model, optim, 6)

    model, optim = _make()
    _train(model, optim, 3)
    pyckpt.save({"model": model, "optim": optim, "step": 3}, tmp_path / "ck")
    model, optim = _make()
    state = {"model": model, "optim": optim, "step": 0}
    pyckpt.load(state, tmp_path / "ck")
    assert state["step"] == 3
    assert _train(model, optim, 3) == expected[3:]


@pytest.mark.parametrize("via", ["save", "manager"])
def test_a_save_before_the_first_step_leaves_the_run_as_it_was(tmp_path: Path, via: str) -> None:
    """torch makes a fresh optimizer's state by a step at lr 0 (``get_optimizer_state_dict``):
    a save at step 0 left Adam one step ahead (its bias correction), and so did a resume from
    that checkpoint."""
    model, optim = _make()
    expected = _train(model, optim, 4)

    model, optim = _make()
    state = {"model": model, "optim": optim, "step": 0}
    if via == "save":
        pyckpt.save(state, tmp_path / "ck")
    else:
        with pyckpt.CheckpointManager(tmp_path / "ck", replicas=0) as mgr:
            mgr.save(0, state)
    assert not optim.state
    assert _train(model, optim, 4) == expected

    model, optim = _make()
    state = {"model": model, "optim": optim, "step": -1}
    if via == "save":
        pyckpt.load(state, tmp_path / "ck")
    else:
        with pyckpt.CheckpointManager(tmp_path / "ck", replicas=0) as mgr:
            assert mgr.restore(state) == 0
    assert state["step"] == 0 and not optim.state
    assert _train(model, optim, 4) == expected


@pytest.mark.parametrize("via", ["load", "manager"])
def test_a_load_that_finds_nothing_leaves_a_fresh_optimizer_as_it_was(
    tmp_path: Path, via: str
) -> None:
    """The load's fresh optimizer state was made in the optimizer itself (torch's step at lr
    0): a ``restore()`` of a job's first run (nothing saved yet, None) or a ``pyckpt.load``
    that failed left Adam one step ahead for the rest of the run."""
    model, optim = _make()
    expected = _train(model, optim, 4)

    model, optim = _make()
    state = {"model": model, "optim": optim, "step": 0}
    if via == "load":
        with pytest.raises(FileNotFoundError):
            pyckpt.load(state, tmp_path / "missing")
    else:
        with pyckpt.CheckpointManager(tmp_path / "ck", replicas=0) as mgr:
            assert mgr.restore(state) is None
    assert not optim.state
    assert _train(model, optim, 4) == expected


@pytest.mark.parametrize("via", ["load", "manager"])
def test_gradients_before_the_load_do_not_keep_the_moments_from_loading(
    tmp_path: Path, via: str
) -> None:
    """torch makes no fresh optimizer state when a parameter has a gradient: after a warm-up
    backward the load asked for no moment and raised ``PartialLoadError`` (its advice, to
    pass ``get_state_dict``'s state, was what the objects already do)."""
    model, optim = _make()
    expected = _train(model, optim, 6)
    model, optim = _make()
    _train(model, optim, 3)
    with pyckpt.CheckpointManager(tmp_path / "ck", replicas=0) as mgr:
        mgr.save(3, {"model": model, "optim": optim})

    model, optim = _make()
    (model(BATCH) ** 2).sum().backward()  # e.g. a warm-up step of a compiled model
    grads = [p.grad for p in model.parameters()]
    state = {"model": model, "optim": optim}
    if via == "load":
        pyckpt.load(state, tmp_path / "ck" / "step-3")
    else:
        with pyckpt.CheckpointManager(tmp_path / "ck", replicas=0) as mgr:
            assert mgr.restore(state) == 3
    assert [p.grad for p in model.parameters()] == grads  # left as they were
    assert _train(model, optim, 3) == expected[3:]


def _with_ema() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
    model, optim = _make()
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    optim.register_step_post_hook(lambda *_: ema.update_parameters(model))
    return model, optim, ema


@pytest.mark.parametrize("k", [0, 3])
def test_the_step_that_makes_a_fresh_optimizer_state_runs_no_step_hook(
    tmp_path: Path, k: int
) -> None:
    """torch makes a fresh optimizer's state by a step at lr 0, which ran the optimizer's
    step hooks: an EMA updated by a post hook was one update ahead after a save at step 0, and
    a resume updated it after loading it."""
    model, optim, ema = _with_ema()
    _train(model, optim, 6)
    expected = [ema.n_averaged.clone(), *ema.parameters()]

    model, optim, ema = _with_ema()
    _train(model, optim, k)
    pyckpt.save({"model": model, "optim": optim, "ema": ema}, tmp_path / "ck")
    model, optim, ema = _with_ema()
    pyckpt.load({"model": model, "optim": optim, "ema": ema}, tmp_path / "ck")
    assert ema.n_averaged.item() == k
    _train(model, optim, 6 - k)
    assert all(torch.equal(a, b) for a, b in zip([ema.n_averaged, *ema.parameters()], expected))


def test_a_parameter_that_never_had_a_gradient_resumes(tmp_path: Path) -> None:
    """A parameter the loss does not use has no optimizer state in the saving run; a fresh
    optimizer's moments were made for every parameter, so the load asked for those of that
    parameter too and failed (``Missing key``)."""
    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, _ = _make()
        model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
        return model, torch.optim.Adam(model.parameters(), lr=0.05)

    model, optim = make()
    expected = _train(model, optim, 6)
    model, optim = make()
    _train(model, optim, 3)
    pyckpt.save({"model": model, "optim": optim}, tmp_path / "ck")
    model, optim = make()
    pyckpt.load({"model": model, "optim": optim}, tmp_path / "ck")
    assert model.unused not in optim.state
    assert _train(model, optim, 3) == expected[3:]


def test_an_optimizer_without_its_model_is_refused(tmp_path: Path) -> None:
    model, optim = _make()
    wrapper = torch.nn.Sequential(model)  # two modules hold the optimizer's parameters
    with pytest.raises(ValueError, match=r"state\['optim'\] is an optimizer"):
        pyckpt.save({"a": model, "b": wrapper, "optim": optim}, tmp_path / "ck")
    with pytest.raises(ValueError, match=r"state\['optim'\] is an optimizer"):
        pyckpt.save({"optim": optim}, tmp_path / "ck")


@pytest.mark.parametrize("via", ["save", "async_save", "manager", "load"])
def test_a_module_or_optimizer_below_the_top_level_is_refused(tmp_path: Path, via: str) -> None:
    """DCP pickled such a model or optimizer whole: the save succeeded, the load refused the
    pickle (weights-only), and ``trusted=True`` put the unpickled copy in the state instead of
    loading into the caller's objects (silently stale)."""
    model, optim = _trained()
    state = {"app": {"model": model, "extra": [optim]}}
    name = r"state\['app'\]\['model'\] is a Sequential" if via != "manager" else "app"
    with pytest.raises(TypeError, match=name if via != "manager" else r"Sequential"):
        if via == "save":
            pyckpt.save(state, tmp_path / "ck")
        elif via == "async_save":
            pyckpt.async_save(state, tmp_path / "ck").result()
        elif via == "load":
            pyckpt.load(state, tmp_path / "ck")
        else:
            with pyckpt.CheckpointManager(tmp_path / "m", replicas=0) as mgr:
                mgr.save(1, state)
                mgr.wait()
    assert not (tmp_path / "ck").exists()
    with pytest.raises(TypeError, match=r"state\['app'\]\['extra'\]\[0\] is a Adam"):
        pyckpt.save({"app": {"extra": [optim]}}, tmp_path / "ck")


# -- several ranks -----------------------------------------------------------------------------


def _fresh_optimizer_on_every_rank(rank: int, world: int, path: str) -> str:
    model, optim = _trained()
    pyckpt.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    model, optim = _make()
    try:
        pyckpt.load({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    except pyckpt.PartialLoadError as e:
        return sorted(e.unloaded)[0]
    return "loaded"


def _held_key_after_cached_plans(rank: int, world: int, path: str) -> list[str]:
    pyckpt.save({"w": torch.ones(4), "loader": _Loader(7)}, path)
    out = []
    for state in ({"w": torch.zeros(4)}, {"w": torch.zeros(4)},  # the second: a cached plan
                  {"w": torch.zeros(4), "loader": _Loader()}):  # same read items, more keys
        try:
            pyckpt.load(state, path)
            out.append("loaded")
        except pyckpt.PartialLoadError as e:
            out.append(sorted(e.unloaded)[0])
    return out


def test_a_cached_plan_does_not_skip_the_check_of_a_new_held_key(tmp_path: Path) -> None:
    assert run_distributed(_held_key_after_cached_plans, 2, str(tmp_path / "ck")) == [
        ["loaded", "loaded", "loader.pos"]] * 2


@pytest.mark.slow
def test_every_rank_raises(tmp_path: Path) -> None:
    assert run_distributed(_fresh_optimizer_on_every_rank, 2, str(tmp_path / "ck")) == [
        "optim.state", "optim.state"]


# -- CheckpointManager -------------------------------------------------------------------------


@pytest.mark.parametrize("fast_tier", [True, False])
def test_manager_restore_of_a_fresh_optimizer_state_dict_raises(
    tmp_path: Path, fast_tier: bool
) -> None:
    local = str(tmp_path / "fast") if fast_tier else None
    model, optim = _trained()
    with pyckpt.CheckpointManager(tmp_path / "durable", local, replicas=0) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": optim.state_dict()})
    model, optim = _make()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    with pyckpt.CheckpointManager(tmp_path / "durable", local, replicas=0) as mgr:
        with pytest.raises(pyckpt.PartialLoadError, match=r"'optim\.state'"):
            mgr.restore(state)
        assert mgr.restore(state, allow_partial=True) == 3
    trained, _ = _trained()
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("fast_tier", [True, False])
def test_manager_takes_the_model_and_optimizer_and_resumes_bit_identically(
    tmp_path: Path, fast_tier: bool
) -> None:
    local = str(tmp_path / "fast") if fast_tier else None
    model, optim = _make()
    expected = _train(model, optim, 6)

    model, optim = _make()
    _train(model, optim, 3)
    with pyckpt.CheckpointManager(tmp_path / "durable", local, replicas=0) as mgr:
        mgr.save(3, {"model": model, "optim": optim, "step": 3})
    model, optim = _make()
    state = {"model": model, "optim": optim, "step": 0}
    with pyckpt.CheckpointManager(tmp_path / "durable", local, replicas=0) as mgr:
        assert mgr.restore(state) == 3
    assert state["step"] == 3 and state["model"] is model and state["optim"] is optim
    assert _train(model, optim, 3) == expected[3:]


def _manager_objects_on_two_nodes(rank: int, world: int, root: str) -> list[float]:
    model, optim = _make()
    _train(model, optim, 3)
    local = root + "/fast-{node}"
    with pyckpt.CheckpointManager(root + "/durable", local, replicas=1, node=rank) as mgr:
        mgr.save(3, {"model": model, "optim": optim})
    model, optim = _make()
    with pyckpt.CheckpointManager(root + "/durable", local, replicas=1, node=rank) as mgr:
        assert mgr.restore({"model": model, "optim": optim}) == 3
        assert mgr.last_restore is not None and mgr.last_restore.tier == "fast"
    return _train(model, optim, 3)


def test_manager_objects_resume_on_two_nodes(tmp_path: Path) -> None:
    model, optim = _make()
    expected = _train(model, optim, 6)[3:]
    assert run_distributed(_manager_objects_on_two_nodes, 2, str(tmp_path)) == [
        expected, expected]


def test_a_generator_in_the_state_resumes_in_place(tmp_path: Path) -> None:
    """A ``torch.Generator`` value is saved as its state and set back into the caller's
    generator; before, the save pickled the object, which the load refused (weights-only) or,
    trusted, replaced instead of restoring the caller's."""
    gen = torch.Generator().manual_seed(7)
    torch.randn(5, generator=gen)
    pyckpt.save({"rng": gen, "step": 3}, tmp_path / "ck")
    expected = torch.randn(4, generator=gen)

    other = torch.Generator().manual_seed(99)
    state = {"rng": other, "step": 0}
    pyckpt.load(state, tmp_path / "ck")
    assert state["rng"] is other and state["step"] == 3
    assert torch.equal(torch.randn(4, generator=other), expected)
