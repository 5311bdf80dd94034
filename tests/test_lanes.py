"""The fast lane (``scripts/test.sh --quick``, ``-m "not slow"``) keeps a test of every module.

The checks see the test modules collected in the run (every one in a run of ``tests/``), before
``-m`` and ``-k`` deselect any test.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).parent

# The only test modules left wholly to the slow lane: each of their tests kills, freezes or
# fuzzes for a long time. Each names the modules whose fast tests cover the same code.
SLOW_ONLY_MODULES = {
    "test_manager_peers.py": "test_manager.py, test_collective.py",
    "test_consolidate_crash.py": "test_consolidate.py, test_consolidate_small.py",
    "test_fuzz_metadata.py": "test_fuzz_harnesses.py, test_native_index.py, test_format.py",
}


def test_every_test_module_keeps_a_test_in_the_fast_lane(lanes: dict[Path, bool]) -> None:
    slow_only = sorted(str(p.relative_to(TESTS)) for p, fast in lanes.items()
                       if not fast and p.name not in SLOW_ONLY_MODULES)
    assert not slow_only, (
        f"every test of {slow_only} is marked slow: leave one representative test of each in "
        "the fast lane, or add the module to SLOW_ONLY_MODULES with the modules that cover its "
        "code")


def test_the_slow_only_modules_exist_and_have_no_fast_test(lanes: dict[Path, bool]) -> None:
    for name, covered_by in SLOW_ONLY_MODULES.items():
        assert (TESTS / name).is_file(), name
        assert lanes.get(TESTS / name) is not True, f"{name} has fast tests: drop it from the list"
        for cover in covered_by.split(", "):
            assert (TESTS / cover).is_file(), cover
            assert lanes.get(TESTS / cover, True), f"{cover} (covering {name}) has no fast test"
