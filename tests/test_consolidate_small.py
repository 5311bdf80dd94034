"""Small exports: the work that runs on the calling thread, the input scan and the index file.

Exports of at most a few MiB copy on the calling thread (no worker threads are started); larger
ones use the worker pool. Both must give the same bit-exact output. Oracle:
``safetensors.torch.load_file`` of every output equals the original tensors, bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _st_workers import grid_blocks, load_outputs, same_bits, sample_tensor, write_dcp_shards
from hypothesis import given
from hypothesis import strategies as st

import pyckpt
from pyckpt import CheckpointFormatError


@pytest.mark.parametrize("rows", [64, 1024 + 64], ids=["under-4MiB", "over-4MiB"])
@pytest.mark.parametrize("threads", [1, 4])
def test_either_side_of_the_inline_bound_is_bit_exact(tmp_path, rows, threads):
    # (rows, 1024) fp32 split along dim 1 (scattered runs) and a bf16 split along dim 0: 0.5 MiB
    # or ~6.5 MiB in all, so the calling-thread path and the worker pool both run.
    full = {
        "a.w": sample_tensor((rows, 1024), torch.float32, 1),
        "b.w": sample_tensor((rows, 1024), torch.bfloat16, 2),
    }
    blocks = {"a.w": grid_blocks((rows, 1024), [1, 3]), "b.w": grid_blocks((rows, 1024), [3, 1])}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, full, blocks, 3)
    seen: list[tuple[int, int]] = []
    res = pyckpt.consolidate(src, dst, threads=threads, fsync=False,
                             progress=lambda d, t: seen.append((d, t)))
    out = load_outputs(res.index_path)
    assert sorted(out) == sorted(full)
    for name, t in full.items():
        assert same_bits(out[name], t), name
    assert seen[-1] == (res.total_bytes, res.total_bytes)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_non_regular_input_entry_is_refused(tmp_path, kind):
    full = {"w": sample_tensor((6, 4), torch.float32, 3)}
    src = str(tmp_path / "src")
    write_dcp_shards(src, full, {"w": grid_blocks((6, 4), [2, 1])}, 2)
    odd = os.path.join(src, "zz-extra.safetensors")
    if kind == "directory":
        os.mkdir(odd)
    else:
        os.mkfifo(odd)  # opening it would block: it must be refused from the directory entry
    dst = tmp_path / "dst"
    with pytest.raises(CheckpointFormatError, match="zz-extra.safetensors.*regular files"):
        pyckpt.consolidate(src, dst, fsync=False)
    assert not dst.exists()


def test_index_file_is_sorted_indented_json_with_the_umask(tmp_path):
    full = {n: sample_tensor((4, 2), torch.float16, i) for i, n in enumerate(["z", "m.b", "m.a"])}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, full, {n: grid_blocks((4, 2), [2, 1]) for n in full}, 2)
    old = os.umask(0o027)
    try:
        res = pyckpt.consolidate(src, dst, fsync=True)
    finally:
        os.umask(old)
    with open(res.index_path, "rb") as fh:
        text = fh.read().decode("utf-8")
    expected = {
        "metadata": {"total_size": res.total_bytes},
        "weight_map": dict.fromkeys(sorted(full), "model-00001-of-00001.safetensors"),
    }
    assert text == json.dumps(expected, indent=2, sort_keys=True) + "\n"
    assert os.stat(res.index_path).st_mode & 0o777 == 0o640
    assert sorted(n for n in os.listdir(dst)) == [
        "model-00001-of-00001.safetensors", "model.safetensors.index.json"
    ]


_NAMES = st.text(min_size=0, max_size=12)  # any code points: quotes, controls, non-ASCII


@given(weight_map=st.dictionaries(_NAMES, _NAMES, max_size=8),
       ties=st.dictionaries(_NAMES, _NAMES, max_size=3),
       total=st.integers(min_value=0, max_value=1 << 62))
def test_index_text_is_json_dumps_with_indent_2_sorted(weight_map, ties, total):
    # The index is written by a faster encoder; its text must be exactly json.dumps's.
    from pyckpt._consolidate.run import index_text

    metadata: dict = {"total_size": total}
    if ties:
        metadata["tied_weights"] = dict(sorted(ties.items()))
    want = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True)
    assert index_text(metadata, weight_map) == want


# --------------------------------------------------------------------- copy threads per rank

@pytest.mark.parametrize("addr, local, world, expected", [
    ("127.0.0.1", None, 4, 4),     # loopback rendezvous: every rank is on this machine
    ("localhost", "1", 2, 2),      # ... whatever torchrun's per-node count says
    ("10.0.0.7", "8", 64, 8),      # a cluster: torchrun's ranks per node
    ("10.0.0.7", "8", 4, 4),       # a subgroup smaller than a node
    ("10.0.0.7", None, 16, 1),     # nothing says: assume one rank per host
])
def test_ranks_on_host(monkeypatch, addr, local, world, expected):
    from pyckpt import _knobs

    monkeypatch.setenv("MASTER_ADDR", addr)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert _knobs.ranks_on_host(world) == expected


@pytest.mark.parametrize("affinity, ranks, env, expected", [
    (2, 2, None, 1),      # 2 ranks on 2 cores: one thread each
    (16, 2, None, 8),     # at most 8
    (16, 4, None, 4),
    (16, 32, None, 1),    # at least 1
    (12, 1, None, 8),     # the CPUs this process may run on, not the machine's
    (4, 2, None, 2),
    (2, 2, "3", 3),       # PYCKPT_NUM_THREADS wins
])
def test_shared_threads_divide_the_cpus(monkeypatch, affinity, ranks, env, expected):
    from pyckpt import _knobs

    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    if env is None:
        monkeypatch.delenv("PYCKPT_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("PYCKPT_NUM_THREADS", env)
    assert _knobs.shared_threads(ranks) == expected


def _arange():
    return torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


def _shared_input(rank, world, root):
    """Rank 0 writes one (64, 48) fp32 tensor as DCP shards along dim 0 (one per rank) under
    ``root/src``; every rank returns that path once it is written."""
    src = os.path.join(root, "src")
    if rank == 0:
        write_dcp_shards(src, {"w": _arange()}, {"w": grid_blocks((64, 48), (world, 1))}, world)
    torch.distributed.barrier()
    return src


def _threads_worker(rank, world, root):
    from pyckpt import _knobs

    src = _shared_input(rank, world, root)
    out = {}
    for label, threads, env in (("default", None, None), ("given", 3, None), ("env", None, 2)):
        with _knobs.override(num_threads=env):
            res = pyckpt.consolidate(src, os.path.join(root, label), threads=threads, fsync=False)
        out[label] = res.threads
    with _knobs.override(num_threads=None):
        return out, _knobs.shared_threads(world)


@pytest.mark.distributed
def test_ranks_of_one_host_share_its_cpus_for_an_export(tmp_path):
    """Two ranks on this machine (loopback rendezvous) each copy with their share of its CPUs
    unless threads= or PYCKPT_NUM_THREADS says otherwise; the outputs stay bit-exact."""
    from dist_utils import run_distributed

    results = run_distributed(_threads_worker, 2, str(tmp_path))
    for out, share in results:
        assert out == {"default": share, "given": 3, "env": 2}, out
        assert share == max(1, min(8, len(os.sched_getaffinity(0)) // 2))
    want = _arange()
    for label in ("default", "given", "env"):
        got = load_outputs(str(tmp_path / label / "model.safetensors.index.json"))
        assert same_bits(got["w"], want), label


_SLOW_SHARE_S = 1.0


def _phases_worker(rank, world, root):
    import time

    import pyckpt._consolidate as consolidation

    src = _shared_input(rank, world, root)
    if rank == 1:  # this rank's share takes a second longer: the others wait for it
        run_share = consolidation.run_share

        def slow_share(*args, **kwargs):
            time.sleep(_SLOW_SHARE_S)
            return run_share(*args, **kwargs)

        consolidation.run_share = slow_share
    res = pyckpt.consolidate(src, os.path.join(root, "dst"), fsync=False)
    return res.phases, res.seconds


@pytest.mark.distributed
def test_phases_say_which_rank_the_others_waited_for(tmp_path):
    """``ConsolidationResult.phases``: plan, copy, wait, commit, in that order, adding up to
    the call's time; a rank whose share is slow shows it as its own ``copy`` and as every other
    rank's ``wait``."""
    from dist_utils import run_distributed

    (fast, fast_s), (slow, slow_s) = run_distributed(_phases_worker, 2, str(tmp_path))
    for phases, seconds in ((fast, fast_s), (slow, slow_s)):
        assert list(phases) == ["plan", "copy", "wait", "commit"]
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) <= seconds + 1e-9  # the same clock readings, summed
    assert slow["copy"] >= _SLOW_SHARE_S
    # Causal (one monotonic clock for both processes): the slow rank starts sleeping after it
    # received the plan, which the fast rank sent after its call began; the fast rank's wait
    # ends after the slow rank's share did. Whatever of the second did not overlap the fast
    # rank's own planning and copying is its wait.
    assert fast["wait"] >= _SLOW_SHARE_S - fast["plan"] - fast["copy"] - 1e-9
    assert same_bits(load_outputs(str(tmp_path / "dst" / "model.safetensors.index.json"))["w"],
                     _arange())


def _late_failure_worker(rank, world, root):
    import pyckpt._consolidate as consolidation

    src = _shared_input(rank, world, root)
    if rank == world - 1:  # the last rank's share fails after it copied; the others succeed
        run_share = consolidation.run_share

        def failing_share(*args, **kwargs):
            run_share(*args, **kwargs)
            raise OSError(28, "No space left on device (injected)")

        consolidation.run_share = failing_share
    dst = os.path.join(root, "dst")
    try:
        pyckpt.consolidate(src, dst, fsync=False)
        out = None
    except OSError as e:
        out = (type(e).__name__, str(e), list(getattr(e, "__notes__", [])))
    torch.distributed.barrier()
    return out, sorted(os.listdir(dst))


@pytest.mark.distributed
def test_a_share_that_fails_after_rank_0_finished_leaves_nothing(tmp_path):
    """Rank 0 finishes its share (and writes the index under its temp name while it waits);
    the last rank's fails: every rank raises that error, and no file is left in ``dst``, the
    index's temp file included."""
    from dist_utils import run_distributed

    results = run_distributed(_late_failure_worker, 3, str(tmp_path))
    for rank, (raised, left) in enumerate(results):
        assert raised is not None and raised[0] == "OSError", raised
        assert "injected" in raised[1]
        assert raised[2] == ([] if rank == 2 else ["pyckpt: consolidation failed on rank 2"])
        assert left == [], left


def _commit_worker(rank, world, root, fail):
    import pyckpt._consolidate as consolidation

    src = _shared_input(rank, world, root)
    ran = []
    commit = consolidation.commit

    def recorded_commit(*args, **kwargs):
        ran.append(rank)
        if fail:
            raise OSError(5, "Input/output error (injected)")
        return commit(*args, **kwargs)

    consolidation.commit = recorded_commit
    dst = os.path.join(root, "dst")
    try:
        res = pyckpt.consolidate(src, dst, fsync=False)
        out = [os.path.basename(f) for f in res.files]
    except OSError as e:
        out = (type(e).__name__, str(e), list(getattr(e, "__notes__", [])))
    torch.distributed.barrier()
    return ran, out, sorted(os.listdir(dst))


@pytest.mark.distributed
def test_the_last_rank_commits_and_every_rank_returns_the_files(tmp_path):
    """The last rank, which starts copying after rank 0 has planned, is the one that commits
    (it usually finishes last: the commit then follows its copy without a message between);
    every rank returns the final files."""
    from dist_utils import run_distributed

    results = run_distributed(_commit_worker, 3, str(tmp_path), False)
    for rank, (ran, files, left) in enumerate(results):
        assert ran == ([2] if rank == 2 else []), (rank, ran)
        assert files == ["model-00001-of-00001.safetensors"], files
        assert left == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert same_bits(load_outputs(str(tmp_path / "dst" / "model.safetensors.index.json"))["w"],
                     _arange())


@pytest.mark.distributed
def test_a_commit_that_fails_on_the_last_rank_leaves_nothing(tmp_path):
    """The commit fails on the rank that runs it (the last): every rank raises its error, the
    others with a note naming that rank, and rank 0 removes every temp file, the index's too."""
    from dist_utils import run_distributed

    results = run_distributed(_commit_worker, 3, str(tmp_path), True)
    for rank, (ran, raised, left) in enumerate(results):
        assert ran == ([2] if rank == 2 else []), (rank, ran)
        assert raised[0] == "OSError" and "injected" in raised[1], raised
        assert raised[2] == ([] if rank == 2 else ["pyckpt: commit failed on rank 2"])
        assert left == [], left


@pytest.mark.parametrize("threads", [0, -2])
def test_bad_thread_count_is_refused_before_anything_is_written(tmp_path, threads):
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    write_dcp_shards(src, {"w": torch.ones(8, 4)}, {"w": grid_blocks((8, 4), (2, 1))}, 2)
    with pytest.raises(ValueError, match=f"threads must be >= 1, got {threads}"):
        pyckpt.consolidate(src, dst, threads=threads, fsync=False)
    assert not dst.exists() or not any(dst.iterdir())


@pytest.mark.parametrize("value, message", [("0", "must be >= 1"), ("two", "not an integer")])
def test_bad_thread_variable_names_it(monkeypatch, value, message):
    from pyckpt import _knobs

    monkeypatch.setenv("PYCKPT_NUM_THREADS", value)
    with pytest.raises(ValueError, match=f"PYCKPT_NUM_THREADS='{value}'.*{message}"):
        _knobs.shared_threads(2)


@pytest.mark.parametrize("world", [2, 3])
def test_plan_pickles_what_the_other_ranks_stitch(tmp_path, world):
    """Rank 0 sends its plan to the others as a pickle carrying only the tensors of their shares,
    as plain tuples: each of them builds the same stitcher items from it as from the whole plan."""
    import importlib
    import pickle

    plan_mod = importlib.import_module("pyckpt._consolidate.plan")
    run = importlib.import_module("pyckpt._consolidate.run")
    scan = importlib.import_module("pyckpt._consolidate.scan")
    sd = {f"l{i:02d}.w": torch.randn(60 + i, 16) for i in range(24)}
    pyckpt.save(sd, tmp_path / "ck", compression="zstd", fsync=False)
    plan = plan_mod.make_plan(scan.scan(str(tmp_path / "ck")), world, None, None)
    sent = pickle.loads(pickle.dumps(plan))
    assert sent.files == plan.files and sent.shares == plan.shares and sent.ties == plan.ties
    assert set(sent.tensors) < set(plan.tensors)  # rank 0's own tensors stay home
    for rank in range(1, world):
        assert run.stitch_items(sent, str(tmp_path), sent.shares[rank]) == run.stitch_items(
            plan, str(tmp_path), plan.shares[rank])


@pytest.mark.parametrize("world", [1, 3])
def test_whole_tensor_items_match_the_general_walk(tmp_path, world):
    """A pyckpt tensor stored whole takes a short path to its stitcher items: the same items as
    the general walk over the piece's dimensions, also when ranks split a tensor."""
    import importlib

    plan_mod = importlib.import_module("pyckpt._consolidate.plan")
    run = importlib.import_module("pyckpt._consolidate.run")
    scan = importlib.import_module("pyckpt._consolidate.scan")
    sd = {"s": torch.tensor(1.5), "v": torch.randn(3000), "m": torch.randn(40, 70, 3),
          "h": torch.randn(9, 1100).to(torch.bfloat16), "e": torch.zeros(0, 4)}
    dcp.save(sd, storage_writer=pyckpt.Writer(tmp_path / "ck", compression="zstd",
                                              chunk_bytes=4096, fsync=False))
    plan = plan_mod.make_plan(scan.scan(str(tmp_path / "ck")), world, None, None)
    for share in plan.shares:
        general = []
        for file_index, lo, hi in share:
            f = plan.files[file_index]
            for name, begin, end in f.tensors:
                a, b = max(lo, begin), min(hi, end)
                if a < b:
                    t = plan.tensors[name]
                    shape, offsets, sizes, item = plan_mod._byte_geometry(t, t.blocks[0])
                    general += run._chunk_items(
                        name, shape, offsets, sizes, t.blocks[0].segments,
                        os.path.join(str(tmp_path), f.tmp), f.data_start + begin, a - begin,
                        b - begin, item, None)
        items = run.stitch_items(plan, str(tmp_path), share)
        assert items == general and len(items) > 0


def _small_model(seed):
    """Many small tensors (odd sizes, several dtypes) around one large one: the large tensor
    (over the stitcher's 256 KiB batch bound) breaks the run of batched neighbours."""
    sd = {}
    for i in range(150):
        dtype = (torch.float32, torch.bfloat16, torch.int8, torch.float16)[i % 4]
        shape = [(7,), (33, 5), (3, 2, 9), (128, 17)][i % 4]
        sd[f"blk.{i:03d}.w"] = sample_tensor(shape, dtype, seed + i)
    sd["blk.075.big"] = sample_tensor((300, 512), torch.float32, seed)  # 600 KiB
    return sd


@pytest.mark.parametrize("source", ["zstd", "raw", "shards"])
@pytest.mark.parametrize("world", [1, 3])
def test_small_tensors_are_written_in_batches(tmp_path, source, world):
    """Small tensors that lie back to back in the output are assembled in one buffer and written
    with one pwrite (a stitcher task per batch, not per tensor), by every rank's share,
    bit-exact, from pyckpt chunks and from safetensors shards alike."""
    import importlib

    plan_mod = importlib.import_module("pyckpt._consolidate.plan")
    run = importlib.import_module("pyckpt._consolidate.run")
    scan = importlib.import_module("pyckpt._consolidate.scan")
    sd = _small_model(11)
    src = str(tmp_path / "in")
    if source == "shards":
        write_dcp_shards(src, sd, {k: grid_blocks(v.shape, [2] + [1] * (v.dim() - 1))
                                   for k, v in sd.items()}, 2)
    else:
        pyckpt.save(sd, src, compression=None if source == "raw" else "zstd", fsync=False)
    dst = str(tmp_path / "out")
    plan = plan_mod.make_plan(scan.scan(src), world, None, None)
    run.create_outputs(plan, dst)
    tasks = 0
    for share in plan.shares:  # each rank's share, one after another
        stats = pyckpt._C.stitch(run.stitch_items(plan, dst, share), 2, 16 << 20, "pread", False)
        assert stats["bytes"] == sum(hi - lo for _, lo, hi in share)
        tasks += stats["tasks"]
    run.commit(plan, dst, False)
    out = load_outputs(os.path.join(dst, "model.safetensors.index.json"))
    assert out.keys() == sd.keys() and all(same_bits(out[k], sd[k]) for k in sd)
    # 151 tensors, ~330 KiB of small ones on either side of the large one: a few batches per
    # share, where one write per tensor would be 150 tasks (the large one's chunks add a few).
    assert tasks <= 6 * world + 20


def test_a_partial_stitch_writes_only_what_it_is_given(tmp_path):
    """With ``partial`` (node-local exports: chunks arrive from peers in rounds), a call writes
    exactly the chunks it holds: tensors whose chunks all arrived are batched (one write for
    neighbours), a tensor with chunks still missing is not, and its other bytes stay as they
    were."""
    import importlib

    import numpy as np

    plan_mod = importlib.import_module("pyckpt._consolidate.plan")
    run = importlib.import_module("pyckpt._consolidate.run")
    scan = importlib.import_module("pyckpt._consolidate.scan")
    sd = {f"t{i:02d}": sample_tensor((40, 90), torch.float32, i) for i in range(20)}
    src = str(tmp_path / "in")
    dcp.save(sd, storage_writer=pyckpt.Writer(src, compression="zstd", chunk_bytes=4096,
                                              fsync=False))
    dst = str(tmp_path / "out")
    plan = plan_mod.make_plan(scan.scan(src), 1, None, None)
    run.create_outputs(plan, dst)
    (f,) = plan.files
    path = os.path.join(dst, f.tmp)
    with open(path, "r+b") as fh:  # a sentinel over the data section
        fh.seek(f.data_start)
        fh.write(b"\xab" * (f.size - f.data_start))
    items = run.stitch_items(plan, dst, plan.shares[0])
    # t00-t09: every chunk has arrived; t10-t19: every other chunk (4 chunks per tensor).
    given_items = [it for it in items if it.name < "t10"]
    given_items += [it for it in items if it.name >= "t10"][::2]
    stats = pyckpt._C.stitch(given_items, 1, 16 << 20, "pread", False, partial=True)
    data = np.fromfile(path, dtype=np.uint8)
    expect = np.full(f.size, 0xAB, dtype=np.uint8)
    expect[: f.data_start] = data[: f.data_start]
    for it in given_items:
        full = sd[it.name].contiguous().view(torch.uint8).reshape(-1).numpy()
        a, b = max(it.p, it.lo), min(it.q, it.hi)
        expect[it.out_offset + a:it.out_offset + b] = full[a:b]
    assert np.array_equal(data, expect)
    assert stats["bytes"] == sum(min(it.q, it.hi) - max(it.p, it.lo) for it in given_items)
    # The ten complete tensors (14 KiB each) in one batch; each chunk of the others a task.
    assert stats["tasks"] == 1 + (len(given_items) - 40)


_BATCH_EFBIG = """
import importlib, resource, signal, sys
import pyckpt
plan_mod = importlib.import_module("pyckpt._consolidate.plan")
run = importlib.import_module("pyckpt._consolidate.run")
scan = importlib.import_module("pyckpt._consolidate.scan")
src, dst = sys.argv[1], sys.argv[2]
plan = plan_mod.make_plan(scan.scan(src), 1, None, None)
run.create_outputs(plan, dst)  # sized before the limit: the writes into it are what fail
items = run.stitch_items(plan, dst, plan.shares[0])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = plan.files[0].data_start + 10000
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    pyckpt._C.stitch(items, 1, 16 << 20, "pread", False)
except OSError as e:
    print("ERROR", e.errno, e.filename, "|", e)
    sys.exit(3)
"""


def test_a_batch_that_cannot_be_written_names_its_tensors(tmp_path):
    """A batch's failed write (here EFBIG under RLIMIT_FSIZE) is an OSError with the errno,
    naming the output file and the tensors the batch held."""
    import errno
    import subprocess
    import sys

    src, dst = tmp_path / "in", tmp_path / "out"
    pyckpt.save({f"t{i:02d}": torch.randn(32, 32) for i in range(40)}, src, compression="zstd",
                fsync=False)
    proc = subprocess.run([sys.executable, "-c", _BATCH_EFBIG, str(src), str(dst)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    code, filename, message = proc.stdout.split("ERROR ", 1)[1].split(" ", 2)
    assert int(code) == errno.EFBIG
    assert os.path.dirname(filename) == str(dst) and filename.endswith(".tmp-" + filename[-12:])
    assert "40 tensors, 't00' to 't39'" in message and "pwrite" in message, message

