"""Shared fixtures and hypothesis profiles for pyckpt's tests."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Multi-rank workers import tests/dist_utils.py in spawned children; tests/ holds no package that
# could shadow the installed pyckpt.
sys.path.insert(0, str(Path(__file__).parent))

# A client left without credentials asks the cloud's instance-metadata service (169.254.169.254)
# for them. Tests send traffic to 127.0.0.1 only: point obstore's lookup at a closed loopback
# port and turn botocore's off, for this process and every worker it starts.
os.environ.setdefault("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True, scope="session")
def _native_index_checked() -> Iterator[None]:
    """Every metadata document the metadata reader reads in this process is read by the Python
    validator kept as its oracle too (tests/_index_oracle.py): the whole suite is a differential
    test of the two, which must build the same index or refuse with the same error."""
    from _index_compare import both_readers

    from pyckpt import _C

    real = _C.parse_pyckpt_index

    def checked(raw: Any, origin: str, **options: Any) -> Any:
        native, reference = both_readers(bytes(raw), origin, **options)
        assert native == reference, f"{origin}: the two readers disagree"
        return real(raw, origin, **options)

    _C.parse_pyckpt_index = checked
    try:
        yield
    finally:
        _C.parse_pyckpt_index = real


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# The longest modules (seconds of each in a 2-worker run of the suite on the 2-core VM,
# 2026-11-26), longest first. scripts/test.sh hands whole modules to the xdist workers in
# collection order (--dist loadfile --no-loadscope-reorder); starting with these keeps the run
# from ending on one worker alone with a long module it picked up last (xdist's default order,
# by test count, put the 4-test peer-fault module after every module of many quick tests).
# test_cuda_staging.py (89 s then) left the list: about 15 s since pytest_collection_finish
# freezes what collection left behind.
_LONGEST_FIRST = (
    "test_peer_faults.py",  # 108 s alone (ranks forked from a preloaded server)
    "test_replicated_save.py",  # 78 s
    "test_nodelocal.py",  # 69 s
    "test_consolidate.py",  # 66 s
    "test_fuzz_metadata.py",  # 65 s
    "test_s3_retries.py",  # 63 s
    "test_s3.py",  # 61 s
    "test_manager.py",  # 194 s before its ranks were forked from the preloaded server; 40 s alone
    "test_attack_harness.py",  # 50 s
    "test_cli.py",  # 44 s
    "test_train_demo.py",  # 44 s
    "test_daemons.py",  # 44 s
    "test_coop_load.py",  # 36 s
)


def _module_order(item: pytest.Item) -> int:
    try:
        return _LONGEST_FIRST.index(item.path.name)
    except ValueError:
        return len(_LONGEST_FIRST)


# The slow lane: tests marked ``slow`` next to them (``@pytest.mark.slow``, or
# ``pytest.param(..., marks=pytest.mark.slow)`` for one case of a parametrization): multi-process
# fault, crash, kill and timeout tests, fuzzing, the demo, the largest multi-rank cases. CI runs
# every test; ``bash scripts/test.sh --quick`` deselects these (-m "not slow"). Every test module
# keeps at least one test in the fast lane, or says why not (tests/test_lanes.py checks both).
_LANES = pytest.StashKey[dict[Path, bool]]()


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: every collected test is seen
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_module_order)  # stable: each module's tests, and the other modules, keep order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    has_cuda = _cuda_available()
    has_fast: dict[Path, bool] = {}
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        fast = item.get_closest_marker("slow") is None
        has_fast[item.path] = has_fast.get(item.path, False) or fast
    config.stash[_LANES] = has_fast


@pytest.fixture
def lanes(request: pytest.FixtureRequest) -> dict[Path, bool]:
    """Every test module collected in this run -> whether it has a test outside the slow lane."""
    return request.config.stash[_LANES]


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so failures reproduce."""
    return np.random.default_rng(20240607)


def _bf16_like(rng: np.random.Generator, nbytes: int) -> bytes:
    """Bytes of bf16 values distributed like trained weights (normal, std 0.02)."""
    torch = pytest.importorskip("torch")
    n = (nbytes + 1) // 2
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    t = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    return t.view(torch.uint8).numpy().tobytes()[:nbytes]


def _fp32_like(rng: np.random.Generator, nbytes: int) -> bytes:
    n = (nbytes + 3) // 4
    return (rng.standard_normal(n).astype(np.float32) * 0.02).tobytes()[:nbytes]


def _fp64_like(rng: np.random.Generator, nbytes: int) -> bytes:
    n = (nbytes + 7) // 8
    return (rng.standard_normal(n) * 0.02).tobytes()[:nbytes]


def _low_entropy(rng: np.random.Generator, nbytes: int) -> bytes:
    # Few distinct symbols with runs: compresses well under any transform.
    return rng.choice(np.array([0, 1, 2, 255], np.uint8), size=nbytes, p=[0.7, 0.1, 0.1, 0.1]).tobytes()


def _random(rng: np.random.Generator, nbytes: int) -> bytes:
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()


DATA_KINDS: dict[str, Callable[[np.random.Generator, int], bytes]] = {
    "random": _random,
    "low_entropy": _low_entropy,
    "bf16": _bf16_like,
    "fp32": _fp32_like,
    "fp64": _fp64_like,
}


@pytest.fixture
def make_data(rng: np.random.Generator) -> Callable[[str, int], bytes]:
    """``make_data(kind, nbytes)`` with kind in random / low_entropy / bf16 / fp32 / fp64."""

    def make(kind: str, nbytes: int) -> bytes:
        return DATA_KINDS[kind](rng, nbytes)

    return make


@pytest.fixture
def thread_pool_factory() -> Iterator[Callable[[int], object]]:
    """``thread_pool_factory(n)`` -> a native ThreadPool shut down after the test."""
    from pyckpt import _C

    pools: list[object] = []

    def make(n: int) -> object:
        pool = _C.ThreadPool(n)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown()


@pytest.fixture(autouse=True)
def _run_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs every test from a scratch directory: subprocesses started with ``python -c`` or
    ``python -m`` put their working directory on sys.path, and the checkout's ``pyckpt/`` (without
    the built ``_C``) must never shadow the installed package."""
    monkeypatch.chdir(tmp_path_factory.getbasetemp())


def pytest_collection_finish(session: pytest.Session) -> None:
    # Everything imported and collected so far (torch, the test modules, hypothesis) lives for the
    # whole run: moved out of the collector's reach, the many tests that call gc.collect() (the
    # staging and pinned-memory tests, twice each) and the interpreter's own full collections stop
    # walking it again and again (test_cuda_staging.py: 25 -> 11 CPU-s).
    gc.collect()
    gc.freeze()
