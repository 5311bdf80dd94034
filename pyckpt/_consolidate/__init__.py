"""Export a sharded checkpoint to standard Hugging Face safetensors files, spread over ranks.

See :func:`consolidate` and ``docs/CONSOLIDATE.md``. The work is three steps, one module each:
:mod:`~pyckpt._consolidate.scan` (input headers or metadata -> ``dict[name, _Tensor]``),
:mod:`~pyckpt._consolidate.plan` (output files, headers, per-rank byte shares) and
:mod:`~pyckpt._consolidate.run` (temp files, native stitching, commit). Between scanning and
planning, :func:`select_tensors` is the seam where a selection step may filter or rename the
scanned tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from pyckpt import _export, _gc, _knobs, _native, _options, _progress
from pyckpt._collective import Group, agree, coordination_arg, group_info
from pyckpt._consolidate.nodelocal import DEFAULT_BATCH_BYTES, run_share_nodelocal
from pyckpt._consolidate.plan import INDEX_NAME, _Plan, make_plan
from pyckpt._consolidate.run import (
    ProgressFn,
    commit,
    commit_files,
    create_outputs,
    prepare_index,
    remove_temps,
    run_share,
    tensor_digest,
    write_index,
)
from pyckpt._consolidate.scan import ScannedTensors, _Tensor, is_pyckpt, scan
from pyckpt._consolidate.staged import consolidate_staged
from pyckpt._exchange import discover
from pyckpt._export import AUTO
from pyckpt._native import apply_native_settings
from pyckpt.backends import open_backend

__all__ = ["consolidate", "ConsolidationResult", "INDEX_NAME", "select_tensors"]

logger = logging.getLogger("pyckpt.consolidate")

_INPUT_MODES = ("pread", "mmap")


def select_tensors(
    tensors: ScannedTensors,
    spec: _export.ExportSpec | None = None,
    *,
    others: Iterable[str] = (),
    digest: Callable[[_Tensor], bytes] | None = None,
) -> tuple[ScannedTensors, _export.ExportChoice | None]:
    """The seam between scanning and planning: the tensors to export, by output name.

    Applies ``spec`` (:func:`pyckpt._export.make_spec`): selection, renaming, the dtype cast and
    tied-weight dedup. Each returned value's ``name`` equals its key; a cast tensor carries
    ``cast_to``. Without a spec every supported tensor is exported under its own name.

    Args:
        tensors: from :func:`~pyckpt._consolidate.scan.scan`.
        spec: the export choices; None: everything, unchanged.
        others: names of non-tensor items (they tell the ``{"model", "optim"}`` layout apart).
        digest: content digest of a tensor, for tied-weight candidates (needed with dedup).

    Returns:
        ``(tensors to export, what was chosen)`` (the choice is None without a spec).
    """
    if spec is None:
        spec = _export.make_spec(select=None)
    supported = {n: t.dtype for n, t in tensors.items() if not t.unsupported}
    unsupported = {n: str(t.unsupported) for n, t in tensors.items() if t.unsupported}
    choice = _export.choose(spec, supported, unsupported, others)
    pairs = _export.tie_candidates(
        choice, spec, supported, {n: t.shape for n, t in tensors.items()}
    )
    if pairs:
        if digest is None:
            raise ValueError("dedup_tied needs a digest function")
        _export.find_ties(
            choice, pairs, lambda src: digest(tensors[src]),
            explicit=not isinstance(spec.dedup_tied, bool),
        )
    out: ScannedTensors = {}
    for name, src in choice.names.items():
        if name in choice.ties:
            continue
        cast = choice.casts.get(name)
        t = tensors[src]
        if name == t.name and cast is None and t.cast_to is None:
            out[name] = t  # unchanged: no copy
        else:
            out[name] = dataclasses.replace(
                t, name=name, cast_to=None if cast is None else cast[1]
            )
    return out, choice


@dataclass(frozen=True)
class ConsolidationResult:
    """What :func:`consolidate` did (the same on every rank except ``rank_bytes``/``seconds``).

    Attributes:
        files: final paths of the safetensors files written, in index order (with
            ``shared_filesystem=False``: only the files this rank wrote into its own ``dst``).
        index_path: path of ``model.safetensors.index.json``.
        total_bytes: tensor data bytes over all files (the index's ``metadata.total_size``).
        rank_bytes: tensor data bytes this rank copied.
        seconds: wall time of the call on this rank.
        threads: native copy threads this rank used.
        selection: one line saying what was exported (and, for the automatic model-only
            choice, how to get everything).
        skipped: tensors left out because safetensors cannot hold their dtype.
        tied: tied weights written once: name left out -> name written.
        phases: seconds this rank spent in each step of the export, in order (they add up to
            about ``seconds``): ``"plan"`` (rank 0 reads the input's metadata, plans and
            creates the temp files; the other ranks wait for the plan), ``"copy"`` (this rank's
            share), ``"wait"`` (for the slowest rank to finish its share), ``"commit"``
            (rank 0 syncs and renames the files, then the index, which it wrote during its
            ``"wait"``; the other ranks wait for it: rank 0's time, which its answer carries,
            while the rest of their wait is ``"wait"``). With
            ``shared_filesystem=False``, ``"plan"`` also covers finding every node's files and
            each rank creating its own outputs, and ``"copy"`` the transfers from other ranks.
            Where a multi-rank export's time goes: a large ``"wait"`` on most ranks means one
            rank's share or storage is slow; a large ``"plan"`` means metadata or planning.
    """

    files: list[str]
    index_path: str
    total_bytes: int
    rank_bytes: int
    seconds: float
    selection: str = ""
    skipped: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    threads: int = 0
    phases: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- public API


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    process_group: Any = None,
    fqn_to_file: Mapping[str, int | str] | None = None,
    max_file_bytes: int | None = None,
    threads: int | None = None,
    fsync: bool | None = None,
    progress: ProgressFn | bool | None = None,
    input_mode: str | None = None,
    select: Any = AUTO,
    strip_prefix: str | list[str] | None = None,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    dtype: Any = None,
    dedup_tied: bool | Mapping[str, str] | None = None,
    shared_filesystem: bool = True,
    batch_bytes: int | None = None,
) -> ConsolidationResult:
    """Writes the full tensors of a sharded checkpoint as standard Hugging Face safetensors files.

    Accepted input (``src``, a directory):

    * a pyckpt checkpoint (the directory holds ``pyckpt.json``; written by
      ``dcp.save(sd, storage_writer=pyckpt.Writer(src, compression=None | "zstd"))``): its
      chunks are read, checksum-verified and decoded natively on the way, one chunk at a time
      per copy thread. Every pyckpt dtype with a safetensors spelling is accepted (all but
      complex128, complex32 and 0-d float4_e2m1fn_x2); non-tensor items (DCP ``BYTE_IO``
      values such as a step counter) have no safetensors form and are skipped;
    * the ``*.safetensors`` files written by DCP's
      ``HuggingFaceStorageWriter(save_distributed=True)`` (each file's ``__metadata__`` carries
      ``DCP_SHARDING_INFO`` with every shard's ``saved_offsets``), and plain safetensors files
      without that key (each tensor then is whole, at offset 0). Every file header is validated
      strictly; all safetensors dtypes are accepted.

    Either way: any tensor rank, shards (DTensor pieces) along any dimension or several, of
    uneven sizes.

    Output (``dst``, created if needed): ``model-0000i-of-0000N.safetensors`` files (8-byte
    aligned header padded with spaces, ``__metadata__ = {"format": "pt"}``, tensors contiguous
    and sorted by name) and ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``). Each file is written under a hidden temp name and renamed only once every
    rank has finished it; the index is renamed last. An earlier export's files in ``dst`` that
    this one does not write are removed before the index lands. A failure or a crash never
    leaves a partial file under a final name (a killed run can leave ``.*.tmp-*`` files behind).

    Every rank of ``process_group`` must call this with the same arguments; each copies a share
    of the output balanced by bytes (whole files when that balances within 5%, else byte ranges
    that may split a file or a tensor). Rank 0 reads the headers or metadata, plans, creates
    and sizes the temp files; all ranks write their ranges (native threads, GIL released, memory
    bounded by ``threads`` x 2 x 16 MiB, or ``threads`` x 2 chunks for pyckpt inputs); rank 0
    writes the index under a temp name while the others finish, and the last rank, once every
    share is in, fsyncs, renames and publishes the index. Processes outside the group must not
    call it. It first waits for this process's :func:`pyckpt.async_save` in flight, as
    :func:`pyckpt.load` does; after ``dcp.async_save``, wait for the returned future
    (``fut.result()``) on every rank before consolidating its output.

    Args:
        src: input directory.
        dst: output directory (may equal ``src``'s parent; must not be ``src`` itself if the
            output names could collide with the inputs).
        process_group: the ranks that share the work; default: the default group when
            ``torch.distributed`` is initialised, else this process alone.
        fqn_to_file: tensor name -> output file, either a 1-based index (files named
            ``model-<i>-of-<max>.safetensors``) or an explicit ``*.safetensors`` basename
            (``model.safetensors`` only for a single file). Must name every tensor.
        max_file_bytes: without ``fqn_to_file``, start a new output file (in name order) before
            a tensor that would push the current one past this many data bytes. Default: one file.
        threads: native copy threads per rank. Default: ``PYCKPT_NUM_THREADS`` when set,
            else the CPUs this process may run on divided among the group's ranks on this
            host (at most 8, at least 1; see :func:`pyckpt._knobs.shared_threads`).
        fsync: fsync outputs before renaming (default ``PYCKPT_FSYNC``, on).
        progress: ``True`` shows the export's progress on stderr (rank 0 only, its share; a bar
            on a terminal, a log line every few seconds otherwise; 100% once the export is
            committed); or a callable, called on this rank as ``progress(bytes_done,
            bytes_total)`` about every 0.1 s from a helper thread while copying.
        input_mode: how input shards are read: ``"pread"`` or ``"mmap"`` (a mapping with
            ``madvise(SEQUENTIAL|WILLNEED)``); default ``PYCKPT_CONSOLIDATE_INPUT``, else
            ``"pread"``.
        select: which tensors to export (see docs/CONSOLIDATE.md, "Choosing what to export").
            Default: when the checkpoint's top level holds ``model`` and ``optim`` (or
            ``optimizer``), as in ``dcp.save({"model": ..., "optim": ...})``, only the tensors
            under ``model.``, named without that prefix (logged, and in ``result.selection``);
            otherwise every tensor. ``None``: every tensor. Else a prefix, a compiled regex
            (``re.search``), a list of prefixes and regexes, or a callable ``(name) -> bool``.
        strip_prefix: prefix(es) removed from the selected names (the longest that matches).
        rename: ``{old_prefix: new_prefix}`` (longest match) or a callable ``(name) -> name``,
            applied after ``strip_prefix``. Two tensors ending with one name raise
            ``ExportNameCollisionError`` naming both.
        dtype: cast floating tensors (F64/F32/F16/BF16) to ``"bf16"``, ``"fp16"`` or ``"fp32"``
            (or ``torch.bfloat16`` ...) natively on the way, rounding to nearest even exactly as
            ``Tensor.to``; integer, bool, complex and float8 tensors are never cast.
        dedup_tied: ``True`` writes an output head tied to the input embedding (2-D tensors of
            equal dtype, shape and bytes, one named ``*embed*``, ``*wte.*`` or ``*shared.*``)
            once, keeping the embedding as ``transformers``' ``save_pretrained`` does; or
            ``{dropped: kept}`` output names, verified equal. Default (None): ``True``, except
            with ``shared_filesystem=False`` (where it is off); ``False`` writes both. Left-out names are listed under ``metadata.tied_weights`` in the
            index (not in ``weight_map``).
        shared_filesystem: False when ``src`` is a node-local pyckpt checkpoint (saved with
            ``shared_filesystem=False``): each rank sees only its own node's files under
            ``src``. Every output file is then written whole by one rank into that rank's
            ``dst``, chunks held by other ranks travel over ``process_group`` (which must carry
            CPU tensors: gloo), and every rank writes the index into its ``dst`` last, once
            every rank's files are in place. ``files`` in the result then lists this rank's
            files only. See docs/CONSOLIDATE.md.
        batch_bytes: with ``shared_filesystem=False``, stored bytes a rank fetches from its
            peers per round (default 64 MiB); bounds the memory of the transfer.

    Returns:
        A :class:`ConsolidationResult`.

    Raises:
        CheckpointFormatError: malformed or inconsistent input (bad header or metadata, offsets
            beyond a file, overlapping shards, a missing shard, mismatched dtypes or ranks);
            names the tensor and file.
        ChecksumError: a pyckpt chunk does not match its recorded checksum (names the tensor,
            the data file and the chunk's offset); no output file is left behind.
        CompressionError: a pyckpt chunk's zstd frame does not decode.
        UnsupportedDtypeError: a selected pyckpt tensor whose dtype safetensors cannot represent
            (names the tensor; unselected ones, and any under the default selection, are
            skipped with a ``UserWarning`` naming them), or a sub-byte dtype sharded at a
            non-byte boundary.
        ExportNameCollisionError: two exported tensors would get the same name.
        FileExistsError: ``dst`` holds a ``model.safetensors`` that no export there wrote
            (``from_pretrained`` would load it instead of the export), before anything is written.
        FileNotFoundError / OSError: I/O failures, with the file name.
        ValueError: bad arguments.
    """
    api = sys.modules.get("pyckpt.api")  # imported by any process that made an async save
    if api is not None:
        api._settle_async()  # as pyckpt.load: an export after an async save sees its commit
    # progress=True: one view for the job (see _progress). The scanned metadata, the plan and
    # the stitcher's items (per tensor, chunk and shard) all live until the call returns: no
    # collection during it frees any of them (pyckpt._gc).
    with _progress.job(progress, "export", process_group) as report, _gc.paused():
        return _consolidate(
            src, dst, process_group=process_group, fqn_to_file=fqn_to_file,
            max_file_bytes=max_file_bytes, threads=threads, fsync=fsync, progress=report,
            input_mode=input_mode, select=select, strip_prefix=strip_prefix, rename=rename,
            dtype=dtype, dedup_tied=dedup_tied, shared_filesystem=shared_filesystem,
            batch_bytes=batch_bytes)


def _consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    process_group: Any,
    fqn_to_file: Mapping[str, int | str] | None,
    max_file_bytes: int | None,
    threads: int | None,
    fsync: bool | None,
    progress: ProgressFn | None,
    input_mode: str | None,
    select: Any,
    strip_prefix: str | list[str] | None,
    rename: Mapping[str, str] | Callable[[str], str] | None,
    dtype: Any,
    dedup_tied: bool | Mapping[str, str] | None,
    shared_filesystem: bool,
    batch_bytes: int | None,
) -> ConsolidationResult:
    start = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    # Exchanges of the export run on a gloo group with the same ranks (even for NCCL).
    process_group = coordination_arg(process_group)
    # Both refuse foreign URL schemes (gs://...) here; node-local applies to a directory only.
    src_backend = open_backend(src, shared_filesystem=shared_filesystem,
                               process_group=process_group)
    dst_backend = open_backend(dst)
    if not (src_backend.in_place and dst_backend.in_place):  # staged via temp files
        return cast(ConsolidationResult, consolidate_staged(
            consolidate, src_backend, dst_backend, process_group=process_group,
            batch_bytes=batch_bytes, fqn_to_file=fqn_to_file,
            max_file_bytes=max_file_bytes, threads=threads, fsync=fsync, progress=progress,
            input_mode=input_mode, select=select, strip_prefix=strip_prefix, rename=rename,
            dtype=dtype, dedup_tied=dedup_tied))
    group = group_info(process_group)
    rank, world = group.rank, group.world
    apply_native_settings()
    nthreads = _copy_threads(threads, group)
    do_fsync = _knobs.fsync() if fsync is None else bool(fsync)
    mode = _knobs.consolidate_input() if input_mode is None else str(
        _options.choice("input_mode", input_mode, _INPUT_MODES))

    if dedup_tied is None:  # tied heads written once (as save_pretrained), where it can tell
        dedup_tied = not src_backend.exchanges_chunks
    spec = _export.make_spec(select, strip_prefix, rename, dtype, dedup_tied)

    if src_backend.exchanges_chunks:
        return _consolidate_nodelocal(
            src, dst, group, fqn_to_file, max_file_bytes, nthreads, do_fsync, progress, mode,
            DEFAULT_BATCH_BYTES if batch_bytes is None else int(batch_bytes), start, spec,
        )

    def plan_and_create() -> tuple[_Plan, _export.ExportChoice | None]:
        others: list[str] = []
        tensors, choice = select_tensors(
            scan(src, others=others), spec, others=others,
            digest=lambda t: tensor_digest(t, dst, nthreads, mode),
        )
        if choice is not None and fqn_to_file is not None:
            _check_tied_files(choice.ties, fqn_to_file)
        p = make_plan(tensors, world, fqn_to_file, max_file_bytes)
        if choice is not None:
            p.ties = dict(choice.ties)
        create_outputs(p, dst)
        return p, choice

    clock = _Phases(start)
    planned, _ = agree(plan_and_create, group, ranks="root", what="planning")
    assert planned is not None
    plan, choice = planned
    cleanup = (lambda: remove_temps(plan, dst)) if rank == 0 else None
    clock.end("plan")

    def share() -> int:
        try:
            copied = run_share(plan, dst, plan.shares[rank], nthreads, do_fsync, progress, mode)
        finally:
            clock.end("copy")
        if rank == 0:  # while the other ranks finish: the commit then only renames it
            prepare_index(plan, dst, do_fsync)
        return copied

    # Every rank agrees that every share is in, then the last rank commits (rank 0 wrote the
    # index while the others copied: the commit only renames) and every rank hears the outcome
    # and how long the commit took.
    root = world - 1

    def timed_commit() -> tuple[list[str], float]:
        t0 = time.perf_counter()
        return commit(plan, dst, do_fsync, index_ready=True), time.perf_counter() - t0

    rank_bytes, _ = agree(share, group, on_failure=cleanup, what="consolidation")
    committed, _ = agree(timed_commit, group, ranks="root", on_failure=cleanup, what="commit",
                         root=root)
    assert committed is not None
    finals, commit_s = committed
    if rank != root:
        finals = [os.path.join(dst, f.name) for f in plan.files]
    clock.split("wait", "commit", commit_s)
    seconds = time.perf_counter() - start
    logger.info(
        "rank %d/%d consolidated %d of %d bytes into %d file(s) in %.3f s (%s)",
        rank, world, rank_bytes, plan.total_bytes, len(plan.files), seconds, clock,
    )
    return ConsolidationResult(
        files=list(finals or []),
        index_path=os.path.join(dst, INDEX_NAME),
        total_bytes=plan.total_bytes,
        rank_bytes=int(rank_bytes or 0),
        seconds=seconds,
        selection="" if choice is None else choice.description,
        skipped=[] if choice is None else list(choice.skipped),
        tied=dict(plan.ties),
        threads=nthreads,
        phases=clock.seconds,
    )


class _Phases:
    """Wall seconds of the steps of one export on this rank (``ConsolidationResult.phases``):
    each :meth:`end` closes the step that ran since the previous one."""

    def __init__(self, start: float) -> None:
        self._last = start
        self.seconds: dict[str, float] = {}

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now

    def split(self, name: str, last: str, last_seconds: float) -> None:
        """Closes two steps that ran as one wait here: ``last`` took ``last_seconds`` (as
        another rank measured them), ``name`` the rest."""
        now = time.perf_counter()
        total = now - self._last
        tail = min(max(last_seconds, 0.0), total)
        self.seconds[name] = total - tail
        self.seconds[last] = tail
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())


def _check_tied_files(ties: Mapping[str, str], fqn_to_file: Mapping[str, int | str]) -> None:
    """``fqn_to_file`` may not place a tied copy that the export leaves out (said as such, not
    as a name missing from the checkpoint)."""
    named = sorted(n for n in ties if n in fqn_to_file)
    if named:
        pairs = ", ".join(f"{n!r} (= {ties[n]!r})" for n in named[:5])
        raise ValueError(
            f"fqn_to_file places {pairs}, tied weights written once (dedup_tied): leave them "
            "out of fqn_to_file, or pass dedup_tied=False to write both copies"
        )


def _copy_threads(threads: int | None, group: Group) -> int:
    """Native copy threads for this rank: ``threads`` when given, else
    :func:`pyckpt._knobs.shared_threads` for the group's ranks on this host
    (:func:`pyckpt._knobs.ranks_on_host`). Ranks of one host that each start ``min(8, cpus)``
    threads only queue for the same cores (BENCHMARKS.md, "Export at the demo's sizes")."""
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return int(threads)
    return _knobs.shared_threads(_knobs.ranks_on_host(group.world))


def _consolidate_nodelocal(
    src: str,
    dst: str,
    group: Group,
    fqn_to_file: Mapping[str, int | str] | None,
    max_file_bytes: int | None,
    nthreads: int,
    do_fsync: bool,
    progress: ProgressFn | None,
    mode: str,
    batch_bytes: int,
    start: float,
    spec: _export.ExportSpec,
) -> ConsolidationResult:
    """consolidate() for a node-local checkpoint (see its ``shared_filesystem`` argument)."""
    if batch_bytes < 1:
        raise ValueError(f"batch_bytes must be positive, got {batch_bytes}")
    if spec.dedup_tied is not False:
        # Comparing the candidates' bytes would need them gathered on rank 0.
        raise ValueError("dedup_tied is not supported with shared_filesystem=False")
    rank = group.rank
    _, files = discover(src, group)  # collective; every rank raises a failure of any rank

    def plan_only() -> tuple[_Plan, _export.ExportChoice | None]:
        if not is_pyckpt(src):
            raise ValueError(
                f"{src}: shared_filesystem=False needs a pyckpt checkpoint (pyckpt.json)"
            )
        others: list[str] = []
        tensors, choice = select_tensors(
            scan(src, check_files=False, others=others), spec, others=others
        )
        return (
            make_plan(tensors, group.world, fqn_to_file, max_file_bytes, whole_files=True),
            choice,
        )

    clock = _Phases(start)
    planned, _ = agree(plan_only, group, ranks="root", what="planning")
    assert planned is not None
    plan, choice = planned
    mine = [i for i, w in enumerate(plan.writers) if w == rank]
    cleanup = lambda: remove_temps(plan, dst, mine)  # noqa: E731
    agree(lambda: create_outputs(plan, dst, mine), group, on_failure=cleanup, what="creating files")
    clock.end("plan")
    try:
        with _native.call_pool(nthreads) as pool:
            rank_bytes = run_share_nodelocal(
                plan, src, dst, files, pool, nthreads, do_fsync, progress, mode, batch_bytes
            )
    except Exception:
        cleanup()
        raise
    clock.end("copy")
    # Every rank's files are written: each commits its own, then (all committed) the index.
    agree(lambda: None, group, on_failure=cleanup, what="consolidation")
    clock.end("wait")
    finals, _ = agree(lambda: commit_files(plan, dst, do_fsync, mine), group,
                      on_failure=cleanup, what="commit")
    write_index(plan, dst, do_fsync)
    clock.end("commit")
    seconds = time.perf_counter() - start
    logger.info(
        "rank %d/%d consolidated %d of %d bytes into %d of %d file(s) in %.3f s (node-local; %s)",
        rank, group.world, rank_bytes, plan.total_bytes, len(mine), len(plan.files), seconds,
        clock,
    )
    return ConsolidationResult(
        files=list(finals or []),
        index_path=os.path.join(dst, INDEX_NAME),
        total_bytes=plan.total_bytes,
        rank_bytes=rank_bytes,
        seconds=seconds,
        selection="" if choice is None else choice.description,
        skipped=[] if choice is None else list(choice.skipped),
        threads=nthreads,
        phases=clock.seconds,
    )
