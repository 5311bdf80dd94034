"""Hostile and damaged inputs: every reader path refuses them with a typed error.

The corpus (``tests/attacks/generate.py``) is generated once per run from a real checkpoint;
``tests/attacks/harness.py`` runs every (case, operation) pair in sandboxed worker processes:
``RLIMIT_AS`` of 4 GiB (a 1 TiB allocation trusted from the file fails instead of swapping; torch
imports and pyckpt's readers need well under 1 GiB), a per-task deadline (a FIFO opened without
O_NONBLOCK is a hang, not a stuck CI job), and inotify watches that see any file outside the
case's checkpoint being opened or written.

Operations: ``pyckpt.load``, ``dcp.load`` with :class:`pyckpt.Reader`, and the CLI commands
``verify``, ``inspect``, ``convert``, ``consolidate``; for safetensors inputs the native header
reader and ``consolidate``. Each must end in a :class:`pyckpt.PyckptError` or ``OSError`` (CLI:
non-zero exit, an ``error:`` line, no traceback), unless the case lists the operation as one that
may succeed (e.g. ``inspect`` reads no tensor data). Never: a crash, a hang, an access outside the
case, the malicious pickle's marker file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from attacks import harness
from attacks.generate import CASES, OPS_PYCKPT, OPS_SAFETENSORS, generate

_BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("attacks"))
    generate(root)
    res = harness.run_tasks(root, harness.tasks_for(root))
    assert not list(Path(root).glob("cases/*/outside/PWNED"))
    return res


def _ops(name: str) -> tuple[str, ...]:
    return OPS_PYCKPT if _BY_NAME[name].kind == "pyckpt" else OPS_SAFETENSORS


def test_corpus_covers_the_brief() -> None:
    # The named attacks this suite exists for; a rename must not silently drop one.
    required = {
        "name_dotdot", "name_absolute", "name_separator", "name_trailing_newline",
        "name_unicode_digits", "data_symlink_outside", "metadata_symlink_outside", "data_fifo",
        "metadata_fifo", "offset_beyond_file", "length_beyond_file", "shape_2_60", "shape_2_64",
        "stored_length_1tib", "decompression_bomb", "overlapping_chunks", "unknown_codec",
        "unknown_transform", "unknown_plane_mode", "unknown_dtype", "unknown_version",
        "transform_code_changed", "pieces_empty", "pieces_half", "json_nested_100k",
        "json_non_utf8", "json_utf16", "json_duplicate_item", "version_float", "version_true",
        "planner_data_tuple_int", "byteio_1tib", "malicious_pickle", "zstd_level_1000",
        "planes_18", "float_offset", "st_header_len_beyond_file", "st_header_len_2_64",
        "st_overlapping_data", "st_offsets_beyond_file", "st_unknown_dtype", "st_huge_shape",
        "st_duplicate_names", "st_non_utf8_header", "st_index_outside",
        # format version 4: a shard missing, truncated, damaged, lying about its digest,
        # swapped between ranks, of another save, or disagreeing with pyckpt.json
        "shard_missing", "shard_truncated", "shard_bytes_flipped", "shard_digest_lie",
        "shard_length_lie", "shard_other_rank", "shard_other_save", "shard_unknown_item",
        "shard_chunk_moved", "shard_segment_dropped", "shard_piece_unknown", "shard_not_holder",
        "shard_grid_lie", "shard_grid_short", "inline_rank_unknown",
        "inline_gap", "inline_chunk_in_shard",
        # a shard is one zstd frame of its JSON: garbage, trailing bytes, no content size, a
        # bomb; and a plain-JSON shard is still checked
        "shard_zstd_garbage", "shard_zstd_trailing", "shard_zstd_no_size", "shard_zstd_bomb",
        "shard_plain_json_other_rank",
    }
    assert required <= set(_BY_NAME)


def test_generator_is_small_and_describes_every_case(tmp_path: Path) -> None:
    generate(str(tmp_path), names=["decompression_bomb", "st_fifo"])
    size = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < 1 << 20  # the 1 TiB bomb is a few KiB on disk
    for name in ("decompression_bomb", "st_fifo"):
        assert (tmp_path / "cases" / name / "DESCRIPTION").read_text().strip()


@pytest.mark.parametrize("name", sorted(_BY_NAME))
def test_attack(name: str, results: dict[tuple[str, str], dict[str, Any]]) -> None:
    case = _BY_NAME[name]
    problems = []
    for op in _ops(name):
        r = results[(name, op)]
        if op in case.trusts_pickles:
            # DCP's DefaultLoadPlanner runs torch.load(weights_only=False): documented, not ours.
            if not (r["outcome"] in ("ok", "ok-wrong") and r["marker"]):
                problems.append(f"{op}: expected DCP's planner to unpickle ({r['outcome']})")
            continue
        allowed = {"typed"}
        if op in case.may_pass:
            allowed |= {"ok"}
        if op in case.any_error:
            allowed |= {"untyped"}
        if r["outcome"] not in allowed:
            problems.append(f"{op}: {r['outcome']} ({r['detail']})")
        if r["outside"]:
            problems.append(f"{op}: touched files outside the checkpoint: {r['outside']}")
        if r["marker"]:
            problems.append(f"{op}: the malicious pickle ran (marker file written)")
    assert not problems, f"{name} ({case.description}):\n  " + "\n  ".join(problems)


@pytest.mark.slow
def test_harness_detects_every_failure_kind(tmp_path: Path) -> None:
    # The harness must be able to fail: each misbehaviour is classified, and the worker chain
    # carries on with the next task after a hang or a crash.
    generate(str(tmp_path), names=["unknown_version"])
    ops = ["selftest_hang", "selftest_ok", "selftest_crash", "selftest_outside",
           "selftest_pickle", "selftest_untyped", "load"]
    # Under ASan a SIGSEGV becomes a sanitizer report (failing the sanitizer stage by design) and
    # there is no RLIMIT_AS to hit.
    native = not harness.under_sanitizer() and harness.default_as_limit() > 0
    if native:
        ops += ["selftest_segv", "selftest_alloc"]
    # The hang (and the task after it, in a restarted worker) under a short deadline; every
    # other task under the usual one, so a slow machine (or the sanitizer build) cannot turn a
    # real result into a "hang".
    res = harness.run_tasks(str(tmp_path), [("unknown_version", op) for op in ops[:2]],
                            timeout=5, jobs=1)
    res.update(harness.run_tasks(str(tmp_path), [("unknown_version", op) for op in ops[2:]],
                                 jobs=1))
    got = {op: res[("unknown_version", op)] for op in ops}
    assert got["selftest_hang"]["outcome"] == "hang"
    assert got["selftest_ok"]["outcome"] == "ok" and not got["selftest_ok"]["outside"]
    assert got["selftest_crash"]["outcome"] == "crash"
    assert "SIGABRT" in got["selftest_crash"]["detail"]
    assert any("selftest-read" in a for a in got["selftest_outside"]["outside"])
    assert got["selftest_pickle"]["marker"]
    assert got["selftest_untyped"]["outcome"] == "untyped"
    if native:
        assert got["selftest_segv"]["outcome"] == "crash"
        assert got["selftest_alloc"]["outcome"] == "untyped"  # RLIMIT_AS is in force
    assert got["load"]["outcome"] == "typed", got["load"]
