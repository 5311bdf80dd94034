"""Coordination and metadata at scale: pyckpt vs DCP for N = 8 .. 4096 ranks, in one process.

For each workload (``sharded``: every tensor FSDP-sharded along dim 0 over all N ranks;
``replicated``: every rank holds every tensor whole, as DDP / FSDP NO_SHARD; ``mixed``: three
tensors in four sharded, the fourth (a norm-sized tensor, 1/16 of the size) replicated), each
world size N and tensor count T, the script builds the N local save plans DCP's local planning
would produce (``WriteItem``\\ s of a bf16 model of ``--model-gib`` GiB plus one replicated
non-tensor item), then times, against DCP on the same plans:

* ``plan`` + ``meta``, the coordinator's first save: the global plan (``pyckpt.SavePlanner`` +
  ``pyckpt.Writer.prepare_global_plan``, with the layout of the sharded metadata, format
  version 4) and the metadata from every rank's write result (one report per rank: where its
  shard is and its digest), vs DCP's ``DefaultSavePlanner`` + ``FileSystemWriter`` (plan, then
  the pickled ``.metadata`` from every rank's write results);
* ``steady``, the coordinator's work in a later save of the same structure: pyckpt's plans are
  cached (``pyckpt._savedrive``), the metadata is the cached layout with this save's reports
  spliced in; DCP with ``enable_plan_caching=True`` (every rank sends an empty plan, the global
  plan is reused, the write results are gathered and the metadata written as always);
* ``load_meta`` + ``load_plan`` for ONE rank (the last): reading the metadata (pyckpt: the
  global document only; DCP: the whole ``.metadata``) and its local load plan (pyckpt: the
  ``LoadPlanner`` through the grid index, and ``Reader.prepare_local_plan``, which reads the
  metadata shards holding its pieces; DCP: ``DefaultLoadPlanner``) for a destination holding
  that rank's shards; the script checks that both plans hold the same read items. Each run
  times this step up to 9 times (while they add up to under 2 s) and keeps the medians.

Sizes: ``bytes``, all metadata (pyckpt: ``pyckpt.json`` plus every rank's shard, which each
rank's ``write_data`` appends to its data file: built here from synthetic raw 4 MiB chunks);
``gathered``, the pickled bytes one rank sends to the coordinator in a steady-state save (the
plan check's probe and its write results; DCP: its empty plan and its write results); and the
number of shards the loading rank read.

Times are the median and [min-max] over ``--repeats`` runs, both systems alternating; no real
ranks, no tensor data (data files are sparse), no I/O beyond the metadata. Cells whose plans
hold more than ``--max-items`` write items are skipped (memory: about 1 KiB per distinct item);
``--max-items 0`` runs everything; ``--systems pyckpt`` leaves DCP out of a cell.

    python benchmarks/bench_scale.py --json scale.json --markdown scale.md --plot scale.png
    python benchmarks/bench_scale.py --ranks 8 64 --tensors 200 --repeats 1   # a quick look

In the synthetic plans the replicated items of all ranks are the same Python objects (DCP's
gather would unpickle distinct copies): it halves the memory and does not change the work
(every copy is still hashed, compared and looked up).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

WORKLOADS = ("sharded", "replicated", "mixed")
SYSTEMS = ("pyckpt", "dcp")
PHASES = ("plan", "meta", "steady", "load_meta", "load_plan")
LOAD_RUNS = 9  # a rank's load step, repeated within one run (see _rank_load)
LOAD_BUDGET_S = 2.0
SIZES = ("bytes", "global_bytes", "gathered", "first_gathered", "shards_read")
CHUNK_BYTES = 4 << 20
_COLS = 1024  # elements per row of every synthetic tensor (bf16: 2 KiB rows)
_ITEMSIZE = 2


# ------------------------------------------------------------------------ synthetic plans


@dataclasses.dataclass(frozen=True)
class _Tensor:
    fqn: str
    rows: int  # global rows (dim 0)
    sharded: bool

    @property
    def size(self) -> torch.Size:
        return torch.Size((self.rows, _COLS))


def model(workload: str, ranks: int, tensors: int, model_bytes: int) -> list[_Tensor]:
    """``tensors`` bf16 tensors of ``model_bytes`` in all, sizes cycling 4:1:1:2 (attention and
    MLP weights); a sharded tensor has at least one row per rank (rows a multiple of N)."""
    weights = [4, 1, 1, 2]
    out = []
    unit = model_bytes / sum(weights[i % 4] for i in range(tensors))
    for i in range(tensors):
        sharded = workload == "sharded" or (workload == "mixed" and i % 4 != 3)
        nbytes = unit * weights[i % 4] / (16 if workload == "mixed" and not sharded else 1)
        rows = max(1, round(nbytes / (_COLS * _ITEMSIZE)))
        if sharded:
            rows = max(1, round(rows / ranks)) * ranks
        out.append(_Tensor(f"layers.{i // 8}.w{i % 8}", rows, sharded))
    return out


_PROPS = TensorProperties(dtype=torch.bfloat16)


def _item(t: _Tensor, rank: int, ranks: int) -> WriteItem:
    if t.sharded:
        rows = t.rows // ranks
        offsets = torch.Size((rank * rows, 0))
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((rows, _COLS)))
        kind = WriteItemType.SHARD
    else:
        offsets = torch.Size((0, 0))
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=t.size)
        kind = WriteItemType.TENSOR
    return WriteItem(
        index=MetadataIndex(t.fqn, offsets),
        type=kind,
        tensor_data=TensorWriteData(chunk=chunk, properties=_PROPS, size=t.size),
    )


def local_plans(tensors: list[_Tensor], ranks: int, digests: bool = False) -> list[SavePlan]:
    """The N local plans (as DCP's local planning makes them, with flatten mappings);
    ``digests``: as ``pyckpt.SavePlanner``'s (``check_replicas=False``), each with the digest
    of its items that each rank computes for itself."""
    from pyckpt._balance import plan_digest
    from pyckpt.planner import _LocalPlan

    mappings = {t.fqn: (t.fqn,) for t in tensors}
    mappings["extra"] = ("extra",)
    shared = [_item(t, 0, ranks) for t in tensors if not t.sharded]
    shared.append(WriteItem(index=MetadataIndex("extra"), type=WriteItemType.BYTE_IO))
    plans: list[SavePlan] = []
    digest = b""
    for rank in range(ranks):
        items = [_item(t, rank, ranks) for t in tensors if t.sharded] + shared
        if not digests:
            plans.append(SavePlan(items=items, planner_data=mappings))
            continue
        if len(items) > len(shared) or not digest:  # replicated only: every rank's is rank 0's
            digest = plan_digest(items, {})
        plans.append(_LocalPlan(items=items, planner_data=mappings, digest=digest))
    return plans


class _Dest(int):
    """A destination value for load planning: a tensor's global size and this rank's chunk
    (what DCP asks of a DTensor through ``__create_chunk_list__``), without any storage.

    An ``int`` subclass only because DCP's state-dict walk in ``set_up_planner`` keeps ints,
    tensors and DTensors and replaces other leaves by None; planning only calls the two methods.
    """

    _size: torch.Size
    _chunk: ChunkStorageMetadata

    def __new__(cls, size: torch.Size, offsets: torch.Size, sizes: torch.Size) -> _Dest:
        self = super().__new__(cls, 0)
        self._size = size
        self._chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        return self

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]


def destination(tensors: list[_Tensor], rank: int, ranks: int) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for t in tensors:
        if t.sharded:
            rows = t.rows // ranks
            sd[t.fqn] = _Dest(t.size, torch.Size((rank * rows, 0)), torch.Size((rows, _COLS)))
        else:
            sd[t.fqn] = _Dest(t.size, torch.Size((0, 0)), t.size)
    sd["extra"] = 0
    return sd


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 64
    return math.prod(item.tensor_data.chunk.sizes) * _ITEMSIZE


def _checksum(k: int) -> int:
    return (k * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)


class _Sink:
    """The end of a rank's data file, as the Writer's sink shows it to ``append_shard``: the
    chunks are not written (the file stays sparse), the shard is."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size

    def append(self, data: bytes) -> None:
        with open(self.path, "wb") as f:
            f.truncate(self.size)
            f.seek(self.size)
            f.write(data)
        self.size += len(data)


def pyckpt_results(plans: list[SavePlan], load_dir: str) -> tuple[list[list[WriteResult]], int]:
    """What each rank's ``pyckpt.Writer.write_data`` does for its final plan: raw 4 MiB chunks of
    its byte range of every item back to back, then its metadata shard (written into
    ``load_dir``, after a sparse region standing for the chunks); returns each rank's one write
    result and the shards' total size."""
    from pyckpt import _format, _format_shards
    from pyckpt.storage import _SHARD_RESULT

    params = _format.codec_params_for("bfloat16", None, 1, True, _format.RAW_THRESHOLD)
    out = []
    serial = 0
    shard_bytes = 0
    for plan in plans:
        rp = plan.storage_data
        if not plan.items:
            out.append([])
            continue
        name = _format.data_file_name(rp.rank, 0, rp.save_id)
        segments: dict[int, list[Any]] = {}
        offset = 0
        for idx, item in enumerate(plan.items):
            start, end = rp.ranges.get(item.index, (0, _nbytes(item)))
            chunks = []
            pos = start
            while pos < end:
                n = min(CHUNK_BYTES, end - pos)
                serial += 1
                chunks.append((offset, n, _checksum(serial), 0, (0, n)))
                offset += n
                pos += n
            segments[idx] = [(name, start, params, chunks)]
        sink = _Sink(os.path.join(load_dir, name), offset)
        shard = _format_shards.append_shard(sink, plan.items, rp.rank, rp.save_id, segments,
                                            rp.inline)
        shard_bytes += shard[1]
        out.append([WriteResult(index=MetadataIndex(_SHARD_RESULT), size_in_bytes=offset,
                                storage_data=_format_shards.ShardWritten(rp.rank, sink.size,
                                                                         *shard))])
    return out, shard_bytes


def dcp_results(plans: list[SavePlan]) -> list[list[WriteResult]]:
    """What each rank's ``FileSystemWriter.write_data`` returns: one ``_StorageInfo`` per item
    (single file per rank, no transforms)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out = []
    for plan in plans:
        name = f"{plan.storage_data.prefix}0.distcp"
        offset = 0
        results = []
        for item in plan.items:
            n = _nbytes(item)
            results.append(WriteResult(index=item.index, size_in_bytes=n,
                                       storage_data=_StorageInfo(name, offset, n, [])))
            offset += n
        out.append(results)
    return out


# -------------------------------------------------------------------------------- systems


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def _rank_load(reader_of: Callable[[], Any], plan_of: Callable[[Any, Any], Any]
               ) -> tuple[float, float, Any, Any]:
    """One rank's metadata read (a new reader from ``reader_of``) and local load plan
    (``plan_of(reader, metadata)``), repeated while it takes little (up to ``LOAD_RUNS`` times
    within ``LOAD_BUDGET_S``: a few milliseconds vary more than that between runs); the median
    of each, the last reader and plan."""
    metas: list[float] = []
    plans: list[float] = []
    spent = 0.0
    while not metas or (len(metas) < LOAD_RUNS and spent < LOAD_BUDGET_S):
        reader = reader_of()
        t_meta, md = _timed(reader.read_metadata)
        t_plan, lp = _timed(plan_of, reader, md)
        metas.append(t_meta)
        plans.append(t_plan)
        spent += t_meta + t_plan
    return statistics.median(metas), statistics.median(plans), reader, lp


def _per_rank(values: list[Any]) -> float:
    """Mean pickled size of one rank's value (what a gather carries from each rank)."""
    return sum(len(pickle.dumps(v)) for v in values) / max(len(values), 1)


def run_pyckpt(tensors: list[_Tensor], ranks: int, work: str) -> dict[str, Any]:
    import pyckpt
    from pyckpt import _format, _format_shards, _gc
    from pyckpt.storage import Writer

    plans = local_plans(tensors, ranks, digests=True)
    first_gathered = _per_rank(plans)
    writer = Writer(os.path.join(work, "save"), metadata_shards=True)
    writer.reset()
    writer.set_up_storage_writer(True)  # the coordinator's save (its directory lock)

    def plan(plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        planner = pyckpt.SavePlanner(check_replicas=False)
        with _gc.paused():
            final, metadata = planner.create_global_plan(plans)
            return writer.prepare_global_plan(final), metadata

    def meta(metadata: Any, results: list[list[WriteResult]]) -> tuple[dict[str, int], bytes]:
        with _gc.paused():  # as Writer.finish does
            return _format_shards.global_document(
                metadata, layout, results, save_id=save_id, created_by="pyckpt",
                planner_data=_format.storable_planner_data(metadata.planner_data))

    t_plan, (final, metadata) = _timed(plan, plans)
    del plans
    layout = final[0].storage_data.layout
    save_id = final[0].storage_data.save_id
    assert layout is not None, "the synthetic pieces form grids"
    load_dir = os.path.join(work, "load")
    os.makedirs(load_dir)
    results, shard_bytes = pyckpt_results(final, load_dir)
    del final
    t_meta, (files, encoded) = _timed(meta, metadata, results)  # first save: builds the layout
    # The steady state (the plan cached, pyckpt._savedrive): each rank's probe (hit, the
    # generation, a hash per replica class: the replicated tensors, held by every rank, are
    # one), then its one write result; the coordinator splices the reports into the cached
    # layout.
    replicated = any(not t.sharded for t in tensors)
    probe = (True, 1 << 61, ((0, (1 << 63) - 1),) if replicated else ())
    gathered = len(pickle.dumps(probe)) + _per_rank([(r, None) for r in results])
    first_gathered += _per_rank([(r, None) for r in results])
    t_steady, (_, again) = _timed(meta, metadata, results)
    assert again == encoded
    writer._active("finish").end()
    del results, metadata
    with open(os.path.join(load_dir, "pyckpt.json"), "wb") as f:
        f.write(encoded)
    dest = destination(tensors, ranks - 1, ranks)

    def load_plan(reader: Any, md: Any) -> Any:
        planner = pyckpt.LoadPlanner()
        planner.set_up_planner(dest, md, False)
        reader.set_up_storage_reader(md, False)
        return reader.prepare_local_plan(planner.create_local_plan())  # reads its shards

    t_load_meta, t_load_plan, reader, lp = _rank_load(lambda: pyckpt.Reader(load_dir), load_plan)
    return {"plan": t_plan, "meta": t_meta, "steady": t_steady, "load_meta": t_load_meta,
            "load_plan": t_load_plan, "bytes": len(encoded) + shard_bytes,
            "global_bytes": len(encoded), "gathered": gathered,
            "first_gathered": first_gathered, "read_items": read_items(lp),
            "shards_read": reader._storage.sharded.shards_read}


def _clear_dcp_plan_cache() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
                 "_cached_metadata", "_cached_final_save_plan"):
        getattr(SavePlanner, name, {}).clear()


def run_dcp(tensors: list[_Tensor], ranks: int, work: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )
    from torch.distributed.checkpoint.metadata import Metadata

    plans = local_plans(tensors, ranks)
    first_gathered = _per_rank(plans)
    writer = FileSystemWriter(os.path.join(work, "save"))

    def plan(plans: list[SavePlan], caching: bool = False) -> tuple[list[SavePlan], Metadata]:
        final, metadata = DefaultSavePlanner(enable_plan_caching=caching).create_global_plan(
            plans)
        return writer.prepare_global_plan(final), metadata

    def meta(metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """FileSystemWriter.finish's document, without the file."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = StorageMeta(checkpoint_id=writer.path, save_id="x" * 36)
        return pickle.dumps(metadata)

    def steady(metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """A save with ``enable_plan_caching=True`` whose local plans did not change: every
        rank sends an empty unusable plan, the coordinator reuses its global plan; the write
        results are gathered and the metadata written as on every save."""
        plan([SavePlan([], usable=False)] * ranks, caching=True)
        return meta(metadata, results)

    _clear_dcp_plan_cache()
    try:
        # fills DCP's plan cache (class-level) for `steady`, with plans of its own
        plan(local_plans(tensors, ranks), caching=True)
        t_plan, (final, metadata) = _timed(plan, plans)
        del plans
        results = dcp_results(final)
        del final
        t_meta, blob = _timed(meta, metadata, results)
        gathered = len(pickle.dumps(SavePlan([], usable=False))) + _per_rank(results)
        first_gathered += _per_rank(results)
        t_steady, _ = _timed(steady, metadata, results)
    finally:
        _clear_dcp_plan_cache()
    del results, metadata
    load_dir = os.path.join(work, "load")
    os.makedirs(load_dir)
    with open(os.path.join(load_dir, ".metadata"), "wb") as f:
        f.write(blob)
    dest = destination(tensors, ranks - 1, ranks)

    def load_plan(reader: Any, md: Any) -> Any:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dest, md, False)
        reader.set_up_storage_reader(md, False)
        return reader.prepare_local_plan(planner.create_local_plan())

    t_load_meta, t_load_plan, _, lp = _rank_load(lambda: FileSystemReader(load_dir), load_plan)
    return {"plan": t_plan, "meta": t_meta, "steady": t_steady, "load_meta": t_load_meta,
            "load_plan": t_load_plan, "bytes": len(blob), "global_bytes": len(blob),
            "gathered": gathered, "first_gathered": first_gathered,
            "read_items": read_items(lp), "shards_read": 0}


RUNNERS = {"pyckpt": run_pyckpt, "dcp": run_dcp}


def read_items(plan: Any) -> frozenset[tuple[Any, ...]]:
    """A load plan's read items, comparable across systems: everything but the position of the
    stored piece in its tensor's list (``storage_index.index``: document order for pyckpt, the
    order of DCP's metadata for DCP); the piece is named by its offsets."""
    return frozenset(
        (it.type, it.dest_index.fqn, tuple(it.dest_index.offset or ()), it.dest_index.index,
         tuple(it.dest_offsets), tuple(it.storage_index.offset or ()), tuple(it.storage_offsets),
         tuple(it.lengths))
        for it in plan.items
    )


def measure(workload: str, ranks: int, tensors: int, repeats: int, model_bytes: int,
            root: str, systems: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    """One cell: every phase of both systems, ``repeats`` times (alternating order)."""
    spec = model(workload, ranks, tensors, model_bytes)
    samples: dict[str, dict[str, list[float]]] = {s: {p: [] for p in PHASES} for s in systems}
    sizes: dict[str, dict[str, float]] = {}
    items: dict[str, frozenset[tuple[Any, ...]]] = {}
    for r in range(repeats):
        for system in systems if r % 2 == 0 else systems[::-1]:
            work = tempfile.mkdtemp(prefix=f"scale-{system}-", dir=root)
            try:
                res = RUNNERS[system](spec, ranks, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            for p in PHASES:
                samples[system][p].append(res[p])
            sizes[system] = {k: res[k] for k in SIZES}
            items[system] = res["read_items"]
    if len(items) == 2 and items["pyckpt"] != items["dcp"]:
        raise AssertionError(f"{workload} N={ranks} T={tensors}: the load plans differ "
                             f"({len(items['pyckpt'])} vs {len(items['dcp'])} read items, "
                             f"{len(items['pyckpt'] ^ items['dcp'])} not in both)")
    return {
        "workload": workload, "ranks": ranks, "tensors": tensors,
        "write_items": ranks * (tensors + 1),
        "samples": samples, "sizes": sizes, "read_items": len(next(iter(items.values()))),
    }


# --------------------------------------------------------------------------------- report


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _coord(row: dict[str, Any], system: str) -> float:
    return _med(row["samples"][system]["plan"]) + _med(row["samples"][system]["meta"])


def _load(row: dict[str, Any], system: str) -> float:
    return _med(row["samples"][system]["load_meta"]) + _med(row["samples"][system]["load_plan"])


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per cell: medians as ``pyckpt / DCP`` (the JSON report keeps every sample)."""
    head = ("| workload | N | T | first save: coordinator s | ratio | steady save: coordinator "
            "s | steady: gathered per rank | metadata (global + shards) | ratio | rank: "
            "metadata + load plan s | shards read |\n"
            "|---|---:|---:|---|---:|---|---|---|---:|---|---:|\n")
    lines = []
    for row in rows:
        if "pyckpt" not in row["sizes"]:
            continue  # a cell of DCP alone (--systems dcp): in the JSON report only
        if "dcp" not in row["sizes"]:
            lines.append(_pyckpt_only(row))
            continue
        sz = row["sizes"]
        a, b = _coord(row, "pyckpt"), _coord(row, "dcp")
        pb, db = sz["pyckpt"]["bytes"], sz["dcp"]["bytes"]
        sa, sb = (_med(row["samples"][x]["steady"]) for x in SYSTEMS)
        la, lb = _load(row, "pyckpt"), _load(row, "dcp")
        lines.append(
            f"| {row['workload']} | {row['ranks']} | {row['tensors']} | {a:.3f} / {b:.3f} "
            f"| {a / b:.2f} | {sa:.3f} / {sb:.3f} | {_size(int(sz['pyckpt']['gathered']))} / "
            f"{_size(int(sz['dcp']['gathered']))} | {_size(int(pb))} / {_size(int(db))} "
            f"| {pb / db:.2f} | {la:.3f} / {lb:.3f} | {int(sz['pyckpt']['shards_read'])} |"
        )
    return head + "\n".join(lines) + "\n"


def _pyckpt_only(row: dict[str, Any]) -> str:
    """A cell measured without DCP (``--systems pyckpt``): DCP's columns are "-"."""
    sz = row["sizes"]["pyckpt"]
    return (f"| {row['workload']} | {row['ranks']} | {row['tensors']} | "
            f"{_coord(row, 'pyckpt'):.3f} / - | - | {_med(row['samples']['pyckpt']['steady']):.3f}"
            f" / - | {_size(int(sz['gathered']))} / - | {_size(int(sz['bytes']))} / - | - | "
            f"{_load(row, 'pyckpt'):.3f} / - | {int(sz['shards_read'])} |")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """First-save and steady-state coordinator time, one rank's load (metadata + plan) and
    the metadata bytes vs N, per workload and T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 5))
    styles = {"pyckpt": "-", "dcp": "--"}
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        series.setdefault((row["workload"], row["tensors"]), []).append(row)
    for n, ((workload, tensors), cells) in enumerate(sorted(series.items())):
        cells.sort(key=lambda r: r["ranks"])
        xs = [c["ranks"] for c in cells]
        color = f"C{n}"
        for system in SYSTEMS:
            if system not in cells[0]["sizes"]:
                continue
            label = f"{system} {workload} T={tensors}"
            first = [_coord(c, system) for c in cells]
            steady = [_med(c["samples"][system]["steady"]) for c in cells]
            load = [_load(c, system) for c in cells]
            size = [c["sizes"][system]["bytes"] for c in cells]
            for ax, ys in zip(axes, (first, steady, load, size)):
                ax.plot(xs, ys, styles[system], color=color, marker="o", label=label)
    titles = ("first save: coordinator (s)", "steady save: coordinator (s; DCP with plan "
              "caching)", "one rank: metadata + load plan (s)", "metadata bytes")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks N")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[3].legend(fontsize=7, loc="upper left")
    fig.suptitle("pyckpt (solid) vs DCP (dashed): coordination and metadata vs world size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--tensors", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="measure these only (a cell too slow for DCP)")
    parser.add_argument("--model-gib", type=float, default=16.0,
                        help="bytes of the synthetic bf16 model (default 16 GiB: an 8B model)")
    parser.add_argument("--max-items", type=int, default=2_000_000,
                        help="skip cells with more write items over all plans (0: no limit)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: tmp)")
    parser.add_argument("--json", default=None,
                        help="write the results here (rewritten after every cell)")
    parser.add_argument("--markdown", default=None, help="write the table here")
    parser.add_argument("--plot", default=None, help="write the plot here (PNG, matplotlib)")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                        help="measure nothing: table and plot of the rows of these reports")
    args = parser.parse_args(argv)
    if args.plot:
        import matplotlib  # noqa: F401  (fail before measuring)
    if args.from_json:
        merged: dict[tuple[str, int, int], dict[str, Any]] = {}
        for name in args.from_json:
            with open(name) as f:
                for row in json.load(f)["rows"]:
                    merged[(row["workload"], row["ranks"], row["tensors"])] = row
        order = {w: i for i, w in enumerate(WORKLOADS)}
        rows = sorted(merged.values(), key=lambda r: (order[r["workload"]], r["tensors"],
                                                      r["ranks"]))
        table = markdown(rows)
        print(table)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(table)
        if args.plot:
            plot(rows, args.plot)
        return 0

    root = tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []

    def write() -> str:  # after every cell: a run stopped early keeps what it measured
        table = markdown(rows)
        report = {
            "host": platform.node(), "python": sys.version.split()[0],
            "torch": torch.__version__, "model_gib": args.model_gib, "repeats": args.repeats,
            "rows": rows, "skipped": skipped,
        }
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(table)
        return table

    try:
        for workload in args.workloads:
            for tensors in args.tensors:
                for ranks in args.ranks:
                    if args.max_items and ranks * (tensors + 1) > args.max_items:
                        skipped.append({"workload": workload, "ranks": ranks,
                                        "tensors": tensors})
                        print(f"skip {workload} N={ranks} T={tensors} "
                              f"({ranks * (tensors + 1)} items > --max-items)", flush=True)
                        continue
                    row = measure(workload, ranks, tensors, args.repeats,
                                  int(args.model_gib * (1 << 30)), root, tuple(args.systems))
                    rows.append(row)
                    s = row["samples"]
                    sz = row["sizes"]
                    print(f"{workload:10s} N={ranks:5d} T={tensors:5d}  " + "  ".join(
                        f"{p} " + "/".join(f"{_med(s[x][p]):.3f}" for x in s)
                        for p in PHASES) + "  bytes " + "/".join(
                        str(sz[x]["bytes"]) for x in sz), flush=True)
                    write()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(write())
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
