"""The ``pyckpt`` command line.

* ``pyckpt inspect CKPT`` summarises a checkpoint from its metadata (no tensor data read).
* ``pyckpt verify CKPT`` reads every chunk, checking sizes, checksums and zstd frames.
* ``pyckpt convert SRC DST`` converts between DCP ``FileSystemWriter`` checkpoints and pyckpt's.
* ``pyckpt bench`` compares pyckpt with DCP's writers/readers on one workload in one run.
* ``pyckpt consolidate SRC DST [--workers N] [--select PREFIX ...] [--dtype bf16] ...`` exports a
  sharded checkpoint (pyckpt's own format or DCP's sharded safetensors) to Hugging Face
  safetensors; the export options mirror :func:`pyckpt.consolidate`'s. With ``--workers N > 1`` it starts
  N local processes that form a gloo group on 127.0.0.1 (no torchrun needed) and share the work
  through :func:`pyckpt.consolidate`; one progress view (pyckpt._progress: a bar on a terminal,
  a log line every few seconds otherwise) sums the bytes the workers report.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import time
from typing import Any

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _consolidate_kwargs(args: argparse.Namespace, threads: int | None) -> dict[str, Any]:
    return {
        "max_file_bytes": args.max_file_bytes,
        "threads": threads,
        "fsync": False if args.no_fsync else None,
        **_export_kwargs(args),
    }


def _export_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The export options (--select, --select-regex, --all, --strip-prefix, --rename, --dtype,
    --dedup-tied, --no-dedup-tied) as keyword arguments of :func:`pyckpt.consolidate`."""
    import re

    kwargs: dict[str, Any] = {}
    chosen: list[Any] = list(args.select or [])
    for pattern in args.select_regex or []:
        try:
            chosen.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"--select-regex {pattern!r}: {e}") from None
    if args.all and chosen:
        raise ValueError("--all exports every tensor; it cannot be combined with --select")
    if args.all:
        kwargs["select"] = None
    elif chosen:
        kwargs["select"] = chosen
    if args.strip_prefix:
        kwargs["strip_prefix"] = list(args.strip_prefix)
    if args.rename:
        mapping: dict[str, str] = {}
        for spec in args.rename:
            old, sep, new = spec.partition("=")
            if not sep or not old:
                raise ValueError(f"--rename takes OLD=NEW (a prefix and its replacement), got {spec!r}")
            mapping[old] = new
        kwargs["rename"] = mapping
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.dedup_tied and args.no_dedup_tied:
        raise ValueError("--dedup-tied and --no-dedup-tied contradict each other")
    if args.dedup_tied or args.no_dedup_tied:
        kwargs["dedup_tied"] = bool(args.dedup_tied)
    return kwargs


def _worker(
    rank: int, world: int, port: int, src: str, dst: str, kwargs: dict[str, Any], q: Any
) -> None:
    """Body of one ``--workers`` process: join the gloo group, consolidate, report."""
    import torch.distributed as dist

    from pyckpt import consolidate

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        try:
            res = consolidate(
                src, dst, progress=lambda d, t: q.put(("progress", rank, d, t)), **kwargs
            )
        finally:
            dist.destroy_process_group()
        q.put(("done", rank, res.rank_bytes, res.total_bytes, len(res.files), res.selection,
               res.seconds))
    except BaseException as e:  # reported to the parent, which decides the exit status
        q.put(("error", rank, f"{type(e).__name__}: {e}"))


def _input_bytes(src: str) -> int | None:
    """Bytes of the files directly in local directory ``src`` (the checkpoint's data); None for
    a URL (not listed here: the export lists it once)."""
    from pyckpt.backends import is_remote

    if is_remote(src):
        return None
    total = 0
    with os.scandir(src) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


def _useful_workers(asked: int, src: str) -> tuple[int, str]:
    """How many of ``asked`` worker processes can help, and why fewer (or ""): at most one per
    core, and one per ``PYCKPT_WORKER_BYTES`` of input (a smaller export is over before more
    processes have started: each costs about a second on a small machine)."""
    from pyckpt.tools import worker_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    per_worker = worker_bytes()
    size = _input_bytes(src) if per_worker else None
    by_size = asked if size is None else max(1, -(-size // per_worker))
    n = min(asked, cores, by_size)
    if n == asked:
        return n, ""
    why = (f"this machine has {cores} core(s)" if n == cores else
           f"the input is {_mib(size or 0)}; a worker process pays off from about "
           f"{_mib(per_worker)} of input each (PYCKPT_WORKER_BYTES)")
    return n, f"--workers {asked}: using {n} ({why})"


def _run_workers(args: argparse.Namespace, n: int, bar: Any) -> tuple[int, int, str, float]:
    """Runs the export on ``n`` local worker processes; returns the total bytes, the number of
    files, the selection line and the export's seconds (the slowest worker's call, start-up
    excluded)."""
    import multiprocessing

    # Forked from a server that imported torch once: spawning N fresh interpreters costs N
    # imports of torch, seconds each on a small machine, more than most exports take.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "pyckpt"])
    q = ctx.Queue()
    port = _free_port()
    threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    kwargs = _consolidate_kwargs(args, threads)
    procs = [
        ctx.Process(target=_worker, args=(r, n, port, args.src, args.dst, kwargs, q), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    done: dict[int, int] = {}
    totals: dict[int, int] = {}
    finished: dict[int, tuple[int, int, str, float]] = {}
    errors: dict[int, str] = {}
    try:
        while len(finished) + len(errors) < n:
            try:
                msg = q.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode]
                for r in dead:
                    if r not in finished and r not in errors:
                        errors[r] = f"worker exited with status {procs[r].exitcode}"
                continue
            kind, rank = msg[0], msg[1]
            if kind == "progress":
                done[rank], totals[rank] = msg[2], msg[3]
                if len(totals) == n:  # the job's total is known once every worker reported
                    bar.update(sum(done.values()), sum(totals.values()))
            elif kind == "done":
                finished[rank] = (msg[3], msg[4], msg[5], msg[6])
            else:
                errors[rank] = msg[2]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"worker {rank}: {errors[rank]}")
    total, nfiles, selection, _ = finished[0]
    return total, nfiles, selection, max(f[3] for f in finished.values())


def _input_dir(path: str) -> None:
    """Raises FileNotFoundError / NotADirectoryError naming ``path`` unless it is a directory."""
    import errno

    from pyckpt.backends import is_remote

    if is_remote(path):  # checked (typed errors naming the URL) when it is read
        return
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "the checkpoint directory does not exist", path)
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "not a checkpoint directory", path)


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from pyckpt.backends import is_remote

    _input_dir(args.src)
    is_remote(args.dst)  # a URL of another scheme (gs://...) fails before any worker starts
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    _export_kwargs(args)  # bad export options fail here, before any worker starts
    from pyckpt.tools import Progress

    workers, why = _useful_workers(args.workers, args.src)
    if why and not args.quiet:
        sys.stderr.write(why + "\n")
    bar = Progress("consolidate", enabled=not args.quiet)
    start = time.perf_counter()
    try:
        if workers == 1:
            from pyckpt import consolidate

            res = consolidate(
                args.src, args.dst, progress=bar.update, **_consolidate_kwargs(args, args.threads)
            )
            total, nfiles, selection = res.total_bytes, len(res.files), res.selection
            export_secs = res.seconds
        else:
            total, nfiles, selection, export_secs = _run_workers(args, workers, bar)
    except BaseException:
        bar.close()
        raise
    bar.finish()  # 100% only now: the outputs are fsynced, renamed and indexed
    secs = time.perf_counter() - start
    if not args.quiet:
        if selection:
            sys.stderr.write(selection.replace("select=None (`--all`)", "--all") + "\n")
        sys.stderr.write(_summary(nfiles, total, secs, export_secs, workers, args.dst) + "\n")
    return 0


def _summary(nfiles: int, total: int, secs: float, export_secs: float, workers: int,
             dst: str) -> str:
    """The last line of ``pyckpt consolidate``: what was written, in how long, and how fast the
    export itself ran (the time the progress line counts); with worker processes, the rest of
    the time is named as their start-up."""
    from pyckpt.tools import rate

    export_secs = min(export_secs, secs)
    text = f"wrote {nfiles} file(s), {_mib(total)} in {secs:.2f} s ("
    if workers > 1:
        text += (f"{secs - export_secs:.2f} s starting {workers} worker processes, "
                 f"{export_secs:.2f} s exporting at ")
    return text + f"{rate(total, export_secs)}) to {dst}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _shown(text: str) -> str:
    """``text`` from a checkpoint as printed: itself when printable, else its repr (a name or
    ``created_by`` with terminal escape sequences must not drive the terminal)."""
    return text if text.isprintable() else repr(text)


def _cmd_inspect(args: argparse.Namespace) -> int:
    _input_dir(args.path)
    from pyckpt import tools

    s = tools.summarize(args.path, top=args.top)
    ratio = s.stored_bytes / s.raw_bytes if s.raw_bytes else 1.0
    print(f"{s.path}: pyckpt format v{s.version}, save {s.save_id}, {_shown(s.created_by)}")
    print(f"  {s.tensors} tensors, {s.bytes_items} other values; {_mib(s.raw_bytes)} raw, "
          f"{_mib(s.stored_bytes)} stored ({ratio:.3f}x) in {len(s.files)} data file(s)")
    print("  by dtype:   " + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(s.dtypes.items())))
    print("  by codec:   " + ", ".join(f"{k} {_mib(v)}" for k, v in sorted(s.codecs.items())))
    if s.rank_bytes:
        per_rank = list(s.rank_bytes.values())
        print(f"  by rank:    {len(per_rank)} rank(s), max/mean "
              f"{max(per_rank) * len(per_rank) / max(1, sum(per_rank)):.3f}: "
              + ", ".join(f"{r}: {_mib(v)}" for r, v in s.rank_bytes.items()))
    if s.largest:
        print(f"  largest {len(s.largest)} tensors:")
        for fqn, dtype, shape, nbytes in s.largest:
            print(f"    {_shown(fqn):<60} {dtype:<10} {list(shape)!s:<20} {_mib(nbytes)}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    _input_dir(args.path)
    from pyckpt import tools

    start = time.perf_counter()
    report = tools.verify(args.path, threads=args.threads, progress=True)  # on stderr
    secs = time.perf_counter() - start
    for name, err in sorted(report.errors.items()):
        print(f"CORRUPT {name}: {err}")
    for name, what in sorted(report.leftovers.items()):
        print(f"LEFTOVER {name}: {what}")
    left = (f"; {len(report.leftovers)} leftover file(s) of saves that did not commit (the next "
            "save into the directory removes them)" if report.leftovers else "")
    print(f"{'OK' if report.ok else 'FAILED'}: {report.items_checked} items, "
          f"{report.chunks_checked} chunks, {_mib(report.bytes_read)} read in {secs:.2f} s; "
          f"{len(report.errors)} bad item(s){left}")
    return 0 if report.ok else 2


def _cmd_convert(args: argparse.Namespace) -> int:
    _input_dir(args.src)
    from pyckpt import tools

    target = tools.convert(args.src, args.dst, to=args.to, compression=args.compression,
                           trusted=args.trusted, overwrite=args.overwrite)
    print(f"converted {args.src} -> {args.dst} ({target} format)")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pyckpt import bench

    return bench.run_cli(args)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, plus ``(default: X)`` after every option whose default is a value
    (not None or a false flag, which would only read "default: None")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (text and "%(default)" not in text and action.option_strings
                and action.default not in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def _build_parser() -> argparse.ArgumentParser:
    from pyckpt.tools import CODECS

    parser = argparse.ArgumentParser(
        prog="pyckpt", description="pyckpt checkpoint tools: inspect, verify, convert and export "
        "checkpoints saved with pyckpt (and DCP's formats), and compare pyckpt with DCP.",
        formatter_class=_HelpFormatter,
        epilog="inspect, verify, convert and consolidate also take s3://bucket/prefix URLs; the "
        "endpoint, region and credentials come from the standard AWS_* environment variables "
        "(AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_ALLOW_HTTP=true for http endpoints) or ~/.aws/credentials and ~/.aws/config. "
        "Run 'pyckpt COMMAND --help' for a command's options.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "consolidate",
        parents=[common], formatter_class=_HelpFormatter,
        help="export a sharded checkpoint to Hugging Face safetensors",
        description="Export a sharded checkpoint to Hugging Face safetensors: "
        "model-0000i-of-0000N.safetensors files plus model.safetensors.index.json. The input is "
        "a pyckpt checkpoint (a directory or s3:// URL written by pyckpt.save or dcp.save with "
        "pyckpt.Writer, any world size, compressed or not) or the sharded safetensors of DCP's "
        "HuggingFaceStorageWriter.",
    )
    p.add_argument("src", help="input: a pyckpt checkpoint (directory or s3:// URL) or a DCP "
                   "sharded safetensors directory")
    p.add_argument("dst", help="output directory or s3:// URL (created if needed)")
    p.add_argument("--workers", type=int, default=1, help="local worker processes (gloo group)")
    p.add_argument("--threads", type=int, default=None,
                   help="copy threads per worker (default: PYCKPT_NUM_THREADS or min(8, cores); "
                   "with --workers N: cores / N)")
    p.add_argument(
        "--max-file-bytes", type=int, default=None,
        help="start a new output file past this size (default: one output file)"
    )
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the outputs")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    g = p.add_argument_group(
        "choosing what to export",
        "Default: a checkpoint saved as {'model': ..., 'optim': ...} exports the model alone, "
        "named without 'model.'; any other checkpoint exports every tensor.",
    )
    g.add_argument("--select", action="append", metavar="PREFIX",
                   help="export tensors whose name starts with PREFIX (repeatable)")
    g.add_argument("--select-regex", action="append", metavar="REGEX",
                   help="export tensors whose name matches REGEX (re.search; repeatable)")
    g.add_argument("--all", action="store_true", help="export every tensor (no default choice)")
    g.add_argument("--strip-prefix", action="append", metavar="PREFIX",
                   help="remove PREFIX from the start of exported names (repeatable)")
    g.add_argument("--rename", action="append", metavar="OLD=NEW",
                   help="replace the name prefix OLD by NEW (repeatable; after --strip-prefix)")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="cast floating tensors on the way (round to nearest even, as torch)")
    g.add_argument("--dedup-tied", action="store_true",
                   help="write an output head tied to the input embedding once (the default, "
                   "as transformers' save_pretrained; the only choice with a node-local input "
                   "is --no-dedup-tied)")
    g.add_argument("--no-dedup-tied", action="store_true",
                   help="write a tied output head and the embedding both")
    p.set_defaults(func=_cmd_consolidate)

    p = sub.add_parser(
        "inspect", parents=[common], formatter_class=_HelpFormatter,
        help="summarise a pyckpt checkpoint (metadata only)",
        description="Summarise a pyckpt checkpoint from its metadata alone (no tensor data is "
        "read): format version, tensors, raw and stored sizes, bytes by dtype, codec and rank, "
        "and the largest tensors.")
    p.add_argument("path", help="checkpoint directory or s3:// URL")
    p.add_argument("--top", type=int, default=10, help="list the N largest tensors")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "verify", parents=[common], formatter_class=_HelpFormatter,
        help="read every chunk and check its checksum and encoding",
        description="Read every stored chunk of a pyckpt checkpoint and check its size, "
        "checksum and zstd frames; lists each damaged item. Exit status 0 when every item is "
        "intact, 2 when one is damaged, 1 on any other error.")
    p.add_argument("path", help="checkpoint directory or s3:// URL")
    p.add_argument("--threads", type=int, default=None,
                   help="reader threads (default: PYCKPT_READ_THREADS or max(8, "
                   "PYCKPT_NUM_THREADS))")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "convert", parents=[common], formatter_class=_HelpFormatter,
        help="convert between DCP FileSystemWriter and pyckpt checkpoints",
        description="Convert a checkpoint between DCP's FileSystemWriter format and pyckpt's "
        "(format detected from the source; the state is loaded into host memory once).",
    )
    p.add_argument("src", help="source checkpoint directory (or s3:// URL of a pyckpt one)")
    p.add_argument("dst", help="destination directory (or s3:// URL for --to pyckpt)")
    p.add_argument("--to", choices=("pyckpt", "dcp"), default=None, type=str.lower,
                   help="target format (default: the other one)")
    p.add_argument(
        "--trusted", action="store_true",
        help="unpickle non-tensor values with torch.load(weights_only=False), which runs any "
        "code a crafted pickle holds: only for checkpoints from a trusted source",
    )
    p.add_argument("--compression", choices=CODECS, default="zstd", type=str.lower,
                   help="compression of a pyckpt target")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what DST holds (without it, a DST that exists and is not empty "
                   "is refused)")
    p.set_defaults(func=_cmd_convert)

    from pyckpt import bench

    p = sub.add_parser(
        "bench", parents=[common], formatter_class=_HelpFormatter,
        help="compare pyckpt with DCP on one workload, same run",
        description="Save and load one workload with pyckpt and with DCP's own writers and "
        "readers in the same run, on the filesystem of --workdir, and print a table of times, "
        "throughputs and sizes (medians over --repeats) with a bit-exactness check of every "
        "load. Exit status 1 when a load is not bit-exact.")
    bench.add_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


# Exit statuses beyond 0 (success), 1 (an error) and 2 (a usage error, or verify's damage):
# what a shell reports for a process ended by SIGINT (Ctrl-C) or SIGPIPE (its reader left).
EXIT_INTERRUPTED = 128 + 2
EXIT_BROKEN_PIPE = 128 + 13


def _stdout_is_gone(e: BaseException) -> bool:
    """Whether ``e`` is the broken pipe of a closed standard output (``pyckpt inspect | head``),
    not one of a socket or file the command itself writes."""
    import stat

    if not isinstance(e, BrokenPipeError):
        return False
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def _quiet_stdout() -> None:
    """Points standard output at /dev/null, so the interpreter's final flush of what is still
    buffered does not fail a second time (and print "Exception ignored ...")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pyckpt`` script; returns the exit status.

    With no arguments it prints the help (the list of commands) on standard output and returns
    0, as ``pip``, ``docker`` and ``cargo`` do: asking what the tool does is not an error. A
    Ctrl-C returns 130 after one line saying what was interrupted (and, for ``convert``, whether
    the checkpoint was committed); a reader of standard output that went away (``| head``)
    ends the command quietly with 141, the status of a process ended by ``SIGPIPE``."""
    parser = _build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stdout)
        return 0
    args = parser.parse_args(argv)
    from pyckpt.errors import PyckptError

    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
        return status
    except KeyboardInterrupt as e:
        if getattr(args, "debug", False):
            raise
        notes = "; ".join(getattr(e, "__notes__", ()))
        sys.stderr.write(f"pyckpt {args.command}: interrupted{'; ' + notes if notes else ''}\n")
        return EXIT_INTERRUPTED
    except (PyckptError, OSError, ValueError, RuntimeError, MemoryError) as e:
        if _stdout_is_gone(e):
            _quiet_stdout()
            return EXIT_BROKEN_PIPE
        # Every pyckpt error class (PyckptError and its subclasses, whatever builtin they also
        # derive from) and every OS failure reaches the user as one line; --debug shows where.
        if getattr(args, "debug", False):
            raise
        sys.stderr.write(f"pyckpt {args.command}: error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
