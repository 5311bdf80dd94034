"""Progress of long operations (save, load, verify, export): one view per job.

* On a terminal the view is a tqdm bar (a plain rewritten line when tqdm is not installed).
* Anywhere else (a log file, a pipe, ``tee``) it writes one complete line every few seconds
  (``PYCKPT_PROGRESS_INTERVAL``), never a carriage return, so logs stay readable.
* It reaches 100% only when the job ends (:meth:`Progress.finish`): bytes copied into the page
  cache are not yet on disk, and the fsync, rename and metadata that follow can take most of the
  time of a large export. Until then the view stops at 99% and says what it is waiting for.
* In a process group only rank 0 draws (``Progress(..., group=...)``); the others stay silent.

Native work reports through a counter the core advances as chunks finish
(:func:`native_counter`: one ``_C.ProgressCounter``, read by one poller thread per job, the
progress thread model of docs/ARCHITECTURE.md, "Threads"); nothing here touches the data path.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = [
    "Progress", "ProgressArg", "native_counter", "is_rank0", "resolve", "job", "local_bytes",
    "plan_bytes", "count_writer", "rate",
]

# What ``progress=`` accepts on the public API: off, a view on stderr (True), a view object, or
# a callback ``(bytes_done, bytes_total)``.
ProgressArg = bool | Callable[[int, int], None] | None

_POLL = 0.1  # seconds between reads of a native counter


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def rate(nbytes: float, secs: float) -> str:
    """``nbytes`` per ``secs`` in a unit that shows it (GiB/s, MiB/s or KiB/s, three
    significant figures or more): a small export never reads "0.00 GiB/s"."""
    per_s = nbytes / max(secs, 1e-9)
    for unit, scale in (("GiB/s", 2**30), ("MiB/s", 2**20)):
        if per_s >= scale:
            return f"{per_s / scale:,.2f} {unit}"
    return f"{per_s / 2**10:,.2f} KiB/s"


def is_rank0(process_group: Any = None) -> bool:
    """True outside a process group, or on rank 0 of ``process_group`` (default: the world)."""
    if process_group is None and "torch.distributed" not in sys.modules:
        return True  # no group can exist yet (see pyckpt._collective.group_info)
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of the callers
        return True
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return bool(dist.get_rank(process_group) == 0)


class Progress:
    """One progress view for one job.

    Args:
        desc: what runs (``"save"``, ``"export"`` ...), the first word of every line.
        stream: where to write (default ``sys.stderr``).
        interval: seconds between plain lines when ``stream`` is not a terminal (default
            ``PYCKPT_PROGRESS_INTERVAL``, 5).
        enabled: False draws nothing (e.g. ranks other than 0).

    Thread-safety: :meth:`update` may be called from any thread (a poller, a queue reader).
    Nothing is written before the first update, so an error found while planning prints no bar.
    """

    def __init__(
        self,
        desc: str,
        *,
        stream: IO[str] | None = None,
        interval: float | None = None,
        enabled: bool = True,
    ) -> None:
        from pyckpt import _knobs

        self.desc = desc
        self._stream = stream if stream is not None else sys.stderr
        self._interval = _knobs.progress_interval() if interval is None else interval
        self._enabled = enabled
        self._lock = threading.Lock()
        self._done = 0
        self._total = 0
        self._started: float | None = None
        self._last_line = 0.0
        self._closed = False
        self._bar: Any = None
        try:
            self._tty = bool(self._stream.isatty())
        except (AttributeError, ValueError):
            self._tty = False

    # -- reporting ------------------------------------------------------------------------------

    def update(self, done: int, total: int) -> None:
        """Records ``done`` of ``total`` bytes; draws (at most every ``interval`` on a log)."""
        if not self._enabled:
            return
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            if self._started is None:
                self._started = now
                self._last_line = now
                self._open_bar()
            self._done, self._total = int(done), int(total)
            if self._bar is not None:
                self._draw_bar(final=False)
            elif self._tty:
                if now - self._last_line >= 0.2:
                    self._last_line = now
                    self._write("\r" + self._text(now, final=False))
            elif now - self._last_line >= self._interval:
                self._last_line = now
                self._write(self._text(now, final=False) + "\n")

    def finish(self) -> None:
        """The job ended: draws the 100% line (once) and closes the view."""
        if not self._enabled:
            return
        with self._lock:
            if self._closed or self._started is None:
                self._closed = True
                return
            self._closed = True
            self._done = self._total
            now = time.monotonic()
            if self._bar is not None:
                self._draw_bar(final=True)
                self._bar.close()
            elif self._tty:
                self._write("\r" + self._text(now, final=True) + "\n")
            else:
                self._write(self._text(now, final=True) + "\n")

    def close(self) -> None:
        """Ends the view without claiming completion (the job failed or was interrupted)."""
        if not self._enabled:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._started is None:
                return
            if self._bar is not None:
                self._bar.close()
            elif self._tty:
                self._write("\n")

    # -- drawing --------------------------------------------------------------------------------

    def _shown(self) -> int:
        # 100% belongs to finish(): until then the work is not over (fsync, rename, metadata).
        return min(self._done, max(self._total - 1, 0))

    def _text(self, now: float, *, final: bool) -> str:
        assert self._started is not None
        secs = now - self._started
        if final:
            return (f"{self.desc}: {_mib(self._total)} / {_mib(self._total)} (100%) "
                    f"in {secs:.1f} s")
        shown = self._shown()
        pct = min(99, 100 * shown // self._total) if self._total else 0  # 100 is finish()'s
        speed = f", {rate(shown, secs)}" if secs > 0 and shown else ""
        waiting = ", finishing (flush, rename, metadata)" if self._done >= self._total > 0 else ""
        return (f"{self.desc}: {_mib(shown)} / {_mib(self._total)} ({pct}%), "
                f"{secs:.1f} s{speed}{waiting}")

    def _open_bar(self) -> None:
        if not self._tty:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=self.desc,
                         file=self._stream, leave=True, dynamic_ncols=True)

    def _draw_bar(self, *, final: bool) -> None:
        bar = self._bar
        bar.total = self._total
        # tqdm rounds its percentage: keep an unfinished job visibly below 100%.
        bar.n = self._total if final else min(self._done, self._total * 99 // 100)
        if not final and self._done >= self._total > 0:
            bar.set_postfix_str("finishing", refresh=False)
        elif final:
            bar.set_postfix_str("", refresh=False)
        bar.refresh()

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # a closed or broken stream never fails the job
            self._enabled = False


def resolve(progress: ProgressArg | Progress, desc: str, process_group: Any = None
            ) -> tuple[Callable[[int, int], None] | None, Progress | None]:
    """Maps a ``progress=`` argument to ``(callback, view)``: ``view`` is the Progress this call
    owns (made for ``True``; finish or close it), ``callback`` what the work reports to."""
    if progress is None or progress is False:
        return None, None
    if progress is True:
        if not is_rank0(process_group):  # one view per job: the other ranks count nothing
            return None, None
        view = Progress(desc)
        return view.update, view
    if isinstance(progress, Progress):
        return progress.update, None
    if callable(progress):
        return progress, None
    raise TypeError(f"progress must be a bool or a callable (done, total), got {progress!r}")


@contextlib.contextmanager
def job(progress: ProgressArg | Progress, desc: str, process_group: Any = None
        ) -> Iterator[Callable[[int, int], None] | None]:
    """Context of one job: yields the callback to report to; a view made here is finished when
    the block ends normally and closed (no 100%) when it raises."""
    callback, view = resolve(progress, desc, process_group)
    try:
        yield callback
    except BaseException:
        if view is not None:
            view.close()
        raise
    if view is not None:
        view.finish()


Counting = Callable[[], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def native_counter(callback: Callable[[int, int], None] | None, total: int | list[int], *,
                   whole_block: bool = True) -> Iterator[Counting]:
    """Counts the raw bytes the native saves/loads/verifies/stitches started on this thread
    finish, and reports ``callback(done, total)`` from a poller thread about every 0.1 s while
    the block runs, then once more when it ends normally. ``total`` may be a one-element list
    filled in later (a save learns its share when DCP has planned); nothing is reported while
    it is 0. No-op without a callback.

    Yields ``counting``: ``with counting():`` counts the native calls of that block only. With
    ``whole_block=False`` nothing else is counted (a consolidation counts its stitches, not the
    chunk exchanges between them)."""
    if callback is None:
        yield contextlib.nullcontext
        return
    from pyckpt import _C

    totals = total if isinstance(total, list) else [total]
    counter = _C.ProgressCounter()
    stop = threading.Event()

    @contextlib.contextmanager
    def counting() -> Iterator[None]:
        _C.set_progress_counter(counter)
        try:
            yield
        finally:
            _C.set_progress_counter(None)

    def report() -> None:
        if totals[0] > 0:
            callback(min(counter.bytes, totals[0]), totals[0])

    def poll() -> None:
        while not stop.wait(_POLL):
            report()

    poller = threading.Thread(target=poll, name="pyckpt-progress", daemon=True)
    poller.start()
    try:
        if whole_block:
            with counting():
                yield counting
        else:
            yield counting
    finally:
        stop.set()
        poller.join()
    report()


def local_bytes(state_dict: Any) -> int:
    """Bytes of the tensors this rank holds in a (nested) state dict (DTensors: the local
    shard): what a load delivers into it."""
    import torch

    total = 0
    stack = [state_dict]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            total += local.numel() * local.element_size()
    return total


def plan_bytes(plan: Any) -> int:
    """Raw tensor bytes a DCP ``SavePlan`` asks this rank to write (split items: their byte
    range, as the pyckpt planner assigned it)."""
    import torch
    from torch.distributed.checkpoint.planner import WriteItemType

    ranges = getattr(plan.storage_data, "ranges", None) or {}
    total = 0
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            continue
        if item.index in ranges:
            start, end = ranges[item.index]
            total += end - start
            continue
        n = 1
        for s in item.tensor_data.size:
            n *= int(s)
        total += n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    return total


def count_writer(writer: Any, totals: list[int]) -> None:
    """Makes ``writer.write_data`` record this rank's planned bytes in ``totals[0]`` (the total
    a save's progress counts towards) before it writes."""
    write_data = writer.write_data

    def counting(plan: Any, planner: Any) -> Any:
        totals[0] = plan_bytes(plan)
        return write_data(plan, planner)

    writer.write_data = counting
