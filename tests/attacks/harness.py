"""Runs the attack corpus through pyckpt's readers in sandboxed worker processes.

Each (case, operation) pair is a *task*. Tasks run in worker processes (``python harness.py
worker ROOT TASK...``) that import torch once and run many tasks in a row, each:

* under an address-space limit (``RLIMIT_AS``, default 4 GiB: a reader that trusts a size from
  the file and allocates it fails here instead of swapping the machine),
* with a per-task deadline enforced by the parent: a task that overruns it is a *hang*; the
  worker is killed and a fresh one resumes with the next task. Deadlines measure a hang, not
  how busy the machine is (see :class:`_Progress`): a task hangs when the worker used no CPU
  time for ``timeout`` seconds (blocked: a FIFO, a sleep, a deadlock) or spent ``timeout``
  seconds of CPU on it (spinning); a machine so loaded that the task only crawls is neither,
* with inotify watches on the case directory and its ``outside/``: any open, read, write or
  creation there (other than in the case's own ``ckpt/`` and ``out/``) is recorded (each case
  has its own ``outside/``, so parallel workers never see each other's accesses),
* checking that the malicious pickle's marker file never appears.

A worker that dies (signal, abort, non-zero exit) while running a task records a *crash* for it;
one that dies before it is ready (importing torch) ran no task, and :func:`run_tasks` raises.

Outcomes: ``ok`` (returned normally; for loads ``ok`` or ``ok-wrong`` when the loaded values
differ from the baseline), ``typed`` (a :class:`pyckpt.PyckptError` or ``OSError``; for the CLI:
a non-zero exit with an ``error:`` line or a ``FAILED`` verify report naming typed errors, no
traceback), ``untyped`` (any other exception, or a CLI traceback), ``hang``, ``crash``.

Usage (reports, not tests)::

    python tests/attacks/harness.py run CORPUS_ROOT     # JSON results on stdout
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["run_tasks", "tasks_for", "default_timeout", "default_startup_idle", "default_as_limit",
           "under_sanitizer"]

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the generator is imported as a sibling module by the workers too
    sys.path.insert(0, _HERE)


def default_timeout() -> float:
    """Per-task deadline in seconds (``PYCKPT_ATTACK_TIMEOUT``, default 20: every task takes well
    under a second of CPU on a quiet machine). It bounds the worker's idle time and its CPU time
    on the task, not the wall-clock time (see :class:`_Progress`)."""
    return float(os.environ.get("PYCKPT_ATTACK_TIMEOUT", "20"))


def default_startup_idle(timeout: float) -> float:
    """How long a starting worker may use no CPU at all before it counts as stuck (seconds):
    ``max(120, 4 * timeout)``. Importing torch reads hundreds of files; a cold disk shared
    with other jobs can keep it waiting, but not for minutes without a single CPU tick."""
    return max(120.0, 4 * timeout)


def under_sanitizer() -> bool:
    """True when the workers run under AddressSanitizer (scripts/sanitize.sh)."""
    return "asan" in os.environ.get("LD_PRELOAD", "") or bool(os.environ.get("ASAN_OPTIONS"))


def default_as_limit() -> int:
    """Address-space limit of a worker in bytes (``PYCKPT_ATTACK_AS_GIB``, default 4; 0 = none).

    No limit under AddressSanitizer, which reserves terabytes of shadow address space."""
    if under_sanitizer():
        return 0
    return int(float(os.environ.get("PYCKPT_ATTACK_AS_GIB", "4")) * 2**30)


# ------------------------------------------------------------------------------------ inotify

_IN_ACCESS, _IN_MODIFY, _IN_CLOSE_WRITE, _IN_OPEN = 0x1, 0x2, 0x8, 0x20
_IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x80, 0x100, 0x200
_IN_ISDIR = 0x40000000
_MASK = (_IN_ACCESS | _IN_MODIFY | _IN_CLOSE_WRITE | _IN_OPEN | _IN_MOVED_TO | _IN_CREATE
         | _IN_DELETE)
_NAMES = {_IN_ACCESS: "read", _IN_MODIFY: "write", _IN_CLOSE_WRITE: "close-write",
          _IN_OPEN: "open", _IN_MOVED_TO: "moved-to", _IN_CREATE: "create", _IN_DELETE: "delete"}


class Watcher:
    """inotify watches on a few directories; reports accesses to entries not allowed."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.fd = fd
        self._dirs: dict[int, tuple[str, frozenset[str]]] = {}

    def watch(self, path: str, allowed: Iterable[str] = ()) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), _MASK)
        if wd < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch", path)
        self._dirs[wd] = (path, frozenset(allowed))

    def drain(self) -> list[str]:
        """Returns the disallowed accesses since the last call, e.g. ``'open outside/x'``."""
        found: list[str] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return found
            pos = 0
            while pos < len(buf):
                wd, mask, _cookie, n = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16 : pos + 16 + n].rstrip(b"\0").decode("utf-8", "replace")
                pos += 16 + n
                if wd not in self._dirs:
                    continue
                path, allowed = self._dirs[wd]
                if name in allowed:
                    continue
                kinds = [v for k, v in _NAMES.items() if mask & k]
                if kinds:
                    found.append(f"{'/'.join(kinds)} {os.path.join(path, name)!r}")

    def close(self) -> None:
        os.close(self.fd)


# ------------------------------------------------------------------------------------ worker


def _typed(e: BaseException) -> bool:
    from pyckpt.errors import PyckptError

    return isinstance(e, (PyckptError, OSError))


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _unwrap(e: BaseException) -> list[BaseException]:
    """DCP's CheckpointException -> the per-rank exceptions it wraps."""
    failures = getattr(e, "failures", None)
    if type(e).__name__ != "CheckpointException" or not failures:
        return [e]
    out = []
    for f in failures.values():
        out.append(f[0] if isinstance(f, tuple) else f)
    return out


_TYPED_NAMES: set[str] = set()


def _typed_name(name: str) -> bool:
    if not _TYPED_NAMES:
        import builtins

        import pyckpt.errors as errors

        for mod in (builtins, errors):
            for k, v in vars(mod).items():
                if isinstance(v, type) and issubclass(v, BaseException) and (
                    issubclass(v, OSError) or issubclass(v, errors.PyckptError)
                ):
                    _TYPED_NAMES.add(k)
    return name in _TYPED_NAMES


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                                     b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)))
    return bool(a == b)


def _run_load(ckpt: str, direct: bool) -> tuple[str, str]:
    import warnings

    import torch.distributed.checkpoint as dcp
    from generate import baseline_state_dict, load_template

    import pyckpt

    sd = load_template()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if direct:
                dcp.load(sd, storage_reader=pyckpt.Reader(ckpt))
            else:
                pyckpt.load(sd, ckpt)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        inner = _unwrap(e)
        if all(_typed(x) for x in inner):
            return "typed", "; ".join(_describe(x) for x in inner)
        return "untyped", "; ".join(_describe(x) for x in inner)
    if _same(baseline_state_dict(), sd):
        return "ok", "loaded bit-exact"
    return "ok-wrong", "loaded without error, values differ from the original"


_CORRUPT_RE = re.compile(r"^CORRUPT .*?: (\w+): ", re.M)


def _run_cli(argv: list[str], verify: bool = False) -> tuple[str, str]:
    from pyckpt import cli

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        return "untyped", "traceback: " + _describe(e)
    text = (out.getvalue() + err.getvalue()).strip()
    tail = text[-400:]
    if rc == 0:
        return "ok", tail
    if "Traceback" in text:
        return "untyped", "traceback in output: " + tail
    if verify and "FAILED" in text:
        names = _CORRUPT_RE.findall(text)
        bad = [n for n in names if not _typed_name(n)]
        if bad:
            return "untyped", f"verify reported untyped errors {bad}: " + tail
        return "typed", tail
    if "error:" in text:
        return "typed", tail
    return "untyped", f"exit {rc} without an error: line: " + tail


def _run_st_header(ckpt: str) -> tuple[str, str]:
    from pyckpt import _C

    try:
        for name in sorted(os.listdir(ckpt)):
            if name.endswith(".safetensors"):
                _C.read_safetensors_header(os.path.join(ckpt, name))
    except Exception as e:
        return ("typed" if _typed(e) else "untyped"), _describe(e)
    return "ok", ""


def _crawl(seconds: float) -> None:
    """Works slowly for ``seconds`` of wall-clock time, as on a machine shared with many
    jobs: short bursts of CPU with pauses between them (the process always makes progress)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        burst = time.process_time() + 0.02
        while time.process_time() < burst:
            pass
        time.sleep(0.1)


def _selftest(what: str, outside: str) -> tuple[str, str]:
    """Misbehaving operations that prove the harness detects each failure (test_attacks.py)."""
    if what == "hang":
        time.sleep(3600)
    elif what == "slow":
        _crawl(12.0)
    elif what == "crash":
        os.abort()
    elif what == "segv":
        ctypes.string_at(0)
    elif what == "outside":
        with open(os.path.join(outside, "selftest-read"), "a"):
            pass
    elif what == "pickle":
        with open(os.path.join(outside, "PWNED"), "w") as f:
            f.write("x")
    elif what == "untyped":
        try:
            raise TypeError("selftest")
        except TypeError as e:
            return ("typed" if _typed(e) else "untyped"), _describe(e)
    elif what == "alloc":
        try:
            bytearray(8 << 30)  # 8 GiB: over the address-space limit
        except MemoryError as e:
            return "untyped", _describe(e)
    return "ok", ""


def _run_task(root: str, case: str, op: str) -> dict[str, Any]:
    cdir = os.path.join(root, "cases", case)
    ckpt = os.path.join(cdir, "ckpt")
    out = os.path.join(cdir, "out", op)
    outside = os.path.join(cdir, "outside")
    marker = os.path.join(outside, "PWNED")
    w = Watcher()
    try:
        w.watch(cdir, allowed=("ckpt", "out", "outside"))  # outside/ has its own watch
        w.watch(outside)
        start = time.monotonic()
        if op in ("load", "dcp_load"):
            outcome, detail = _run_load(ckpt, direct=op == "dcp_load")
        elif op == "verify":
            outcome, detail = _run_cli(["verify", ckpt], verify=True)
        elif op == "inspect":
            outcome, detail = _run_cli(["inspect", ckpt])
        elif op == "convert":
            outcome, detail = _run_cli(["convert", ckpt, out, "--to", "dcp"])
        elif op == "consolidate":
            outcome, detail = _run_cli(["consolidate", ckpt, out, "--quiet", "--no-fsync"])
        elif op == "st_header":
            outcome, detail = _run_st_header(ckpt)
        elif op.startswith("selftest_"):
            outcome, detail = _selftest(op[9:], outside)
        else:
            raise ValueError(f"unknown operation {op!r}")
        secs = time.monotonic() - start
        accesses = w.drain()
        pwned = os.path.exists(marker)
        if pwned:
            os.unlink(marker)
            w.drain()
    finally:
        w.close()
    return {"case": case, "op": op, "outcome": outcome, "detail": detail,
            "outside": accesses, "marker": pwned, "seconds": round(secs, 3)}


def _worker(root: str, tasks: list[str]) -> int:
    # Test hook (test_attack_harness.py): a start-up that crawls ("slow:SECONDS"), is stuck, or
    # dies once a file exists ("abort-if:PATH", so only a worker started after a task made it).
    start_test = os.environ.get("PYCKPT_ATTACK_SELFTEST_START", "")
    if start_test.startswith("slow:"):
        _crawl(float(start_test[5:]))
    elif start_test == "stuck":
        time.sleep(3600)
    elif start_test.startswith("abort-if:") and os.path.exists(start_test[9:]):
        os.abort()
    limit = default_as_limit()
    if limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path.insert(0, _HERE)
    import torch  # noqa: F401 - imported once, before the first deadline

    import pyckpt.cli
    import pyckpt.storage  # noqa: F401

    print("READY", flush=True)
    for task in tasks:
        case, op = task.split(":", 1)
        print(f"START {task}", flush=True)
        res = _run_task(root, case, op)
        print("RESULT " + json.dumps(res), flush=True)
    return 0


# ------------------------------------------------------------------------------------ parent

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads, plus waited-for children) of process ``pid``, or
    None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    # fields[0] is the state (field 3 of proc(5)): utime..cstime are fields 14..17.
    return sum(int(x) for x in fields[11:15]) / _CLK_TCK


class _Progress:
    """Whether a worker process is making progress on its current phase (start-up or a task).

    On a loaded machine a working process runs less often, but it runs: its CPU time keeps
    growing. A process that is *stuck* (blocked on a FIFO, sleeping, deadlocked) uses no CPU
    at all; one that *spins* uses CPU without end. So a phase fails when the process used no
    CPU for ``idle_s`` seconds, or more than ``cpu_s`` CPU seconds; wall-clock time alone, which
    is what a busy machine stretches, only fails it past ``wall_s`` (a last resort for a
    process that wakes up now and then forever).
    """

    def __init__(self, pid: int, idle_s: float, cpu_s: float, wall_s: float) -> None:
        self.pid, self.idle_s, self.cpu_s, self.wall_s = pid, idle_s, cpu_s, wall_s
        self.start = self.last_busy = time.monotonic()
        self.cpu0 = self.cpu_last = _cpu_seconds(pid) or 0.0

    def failure(self) -> str | None:
        """Why the phase failed (a sentence), or None while it may go on."""
        now = time.monotonic()
        cpu = _cpu_seconds(self.pid)
        if cpu is None:
            return None  # exited: the caller sees EOF and classifies the exit
        if cpu > self.cpu_last:
            self.cpu_last, self.last_busy = cpu, now
        if now - self.last_busy > self.idle_s:
            return f"no progress: no CPU time used for {self.idle_s:g} s"
        if cpu - self.cpu0 > self.cpu_s:
            return f"no result after {self.cpu_s:g} s of CPU time"
        if now - self.start > self.wall_s:
            return f"no result within {self.wall_s:g} s"
        return None



def tasks_for(root: str) -> list[tuple[str, str]]:
    """Every (case, op) pair of the corpus at ``root``."""
    from generate import OPS_PYCKPT, OPS_SAFETENSORS

    tasks = []
    for name in sorted(os.listdir(os.path.join(root, "cases"))):
        with open(os.path.join(root, "cases", name, "case.json")) as f:
            meta = json.load(f)
        ops = OPS_PYCKPT if meta["kind"] == "pyckpt" else OPS_SAFETENSORS
        tasks.extend((name, op) for op in ops)
    return tasks


def _spawn(root: str, tasks: list[tuple[str, str]]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # stderr goes to a file: a pipe nobody reads while waiting could fill and stall the worker.
    err = tempfile.TemporaryFile("w+")
    p = subprocess.Popen(
        [sys.executable, os.path.join(_HERE, "harness.py"), "worker", root]
        + [f"{c}:{o}" for c, o in tasks],
        stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
    )
    p.errfile = err  # type: ignore[attr-defined]
    return p


def _stderr_of(p: subprocess.Popen[bytes]) -> str:
    f = p.errfile  # type: ignore[attr-defined]
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _kill(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    _stderr_of(p)
    p.stdout.close()  # type: ignore[union-attr]


class _Chain:
    """One worker at a time over a list of tasks, restarted after a hang or crash."""

    def __init__(self, root: str, tasks: list[tuple[str, str]], timeout: float,
                 startup_idle: float | None = None) -> None:
        self.root, self.todo, self.timeout = root, list(tasks), timeout
        self.startup_idle = default_startup_idle(timeout) if startup_idle is None else startup_idle
        self.results: dict[tuple[str, str], dict[str, Any]] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.current: tuple[str, str] | None = None
        self.progress: _Progress | None = None
        self.ready = False
        self.buf = ""
        self.restarts = 0

    def start(self) -> None:
        self.proc = _spawn(self.root, self.todo)
        self.current = None
        self.ready = False
        self.buf = ""
        # Start-up (importing torch and pyckpt) may crawl on a busy machine: only a worker that
        # stops using CPU altogether fails it (no CPU or wall bound short enough to be met by
        # a slow machine).
        self.progress = _Progress(self.proc.pid, self.startup_idle,
                                  cpu_s=max(600.0, 10 * self.timeout),
                                  wall_s=max(3600.0, 60 * self.timeout))
        os.set_blocking(self.proc.stdout.fileno(), False)  # type: ignore[union-attr]

    def _task_clock(self) -> None:
        assert self.proc is not None
        self.progress = _Progress(self.proc.pid, self.timeout, cpu_s=self.timeout,
                                  wall_s=30 * self.timeout)

    @property
    def done(self) -> bool:
        return not self.todo and self.proc is None

    def fileno(self) -> int:
        return self.proc.stdout.fileno()  # type: ignore[union-attr]

    def _fail_current(self, outcome: str, detail: str) -> None:
        task = self.current if self.current is not None else self.todo[0]
        self.results[task] = {"case": task[0], "op": task[1], "outcome": outcome,
                              "detail": detail, "outside": [], "marker": False, "seconds": None}
        self.todo.remove(task)
        self.restarts += 1

    def _line(self, line: str) -> None:
        if line.startswith("READY"):
            self.ready = True
            self._task_clock()
        elif line.startswith("START "):
            c, o = line[6:].split(":", 1)
            self.current = (c, o)
            self._task_clock()
        elif line.startswith("RESULT "):
            res = json.loads(line[7:])
            task = (res["case"], res["op"])
            self.results[task] = res
            self.todo.remove(task)
            self.current = None

    def poll(self) -> None:
        assert self.proc is not None
        try:
            chunk: str | None = os.read(self.fileno(), 1 << 16).decode("utf-8", "replace")
        except BlockingIOError:
            chunk = None
        if chunk:
            self.buf += chunk
            *lines, self.buf = self.buf.split("\n")
            for line in lines:
                self._line(line)
        eof = chunk == ""
        if eof:
            rc = self.proc.wait()
            err = _stderr_of(self.proc)[-2000:]
            self.proc.stdout.close()  # type: ignore[union-attr]
            self.proc = None
            how = (f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}")
            if self.todo:
                # A worker that dies before READY never ran a task: its start-up failed, first
                # worker or one started after a hang or crash. Charging the next task with a
                # crash would blame a case that was never run (and hide why start-up failed).
                if not self.ready:
                    raise RuntimeError(f"attack worker failed to start ({how}): {err}")
                self._fail_current("crash", f"worker {how}: {err.strip()[-600:]}")
                if self.todo:
                    self.start()
            return
        assert self.progress is not None
        why = self.progress.failure()
        if why is not None:
            _kill(self.proc)
            self.proc = None
            if not self.todo:
                return  # every result is in: a worker slow to exit has nothing left to lose
            if not self.ready:
                raise RuntimeError(f"attack worker did not start: {why}")
            self._fail_current("hang", why)
            if self.todo:
                self.start()


def run_tasks(root: str, tasks: list[tuple[str, str]], *, timeout: float | None = None,
              jobs: int | None = None, startup_idle: float | None = None,
              ) -> dict[tuple[str, str], dict[str, Any]]:
    """Runs ``tasks`` in ``jobs`` parallel worker chains; returns results by task.

    Args:
        timeout: per-task bound on idle time and on CPU time (default :func:`default_timeout`).
        startup_idle: how long a starting worker may use no CPU (default
            :func:`default_startup_idle`).

    Raises:
        RuntimeError: a worker failed to start, or stopped making progress before it was ready.
    """
    timeout = default_timeout() if timeout is None else timeout
    jobs = jobs or int(os.environ.get("PYCKPT_ATTACK_JOBS", "0")) or min(2, os.cpu_count() or 1)
    # Whole cases go to one chain (so a case's ops share one corpus directory sequentially).
    by_case: dict[str, list[tuple[str, str]]] = {}
    for t in tasks:
        by_case.setdefault(t[0], []).append(t)
    shares: list[list[tuple[str, str]]] = [[] for _ in range(jobs)]
    for i, name in enumerate(sorted(by_case)):
        shares[i % jobs].extend(by_case[name])
    chains = [_Chain(root, s, timeout, startup_idle) for s in shares if s]
    try:
        for ch in chains:
            ch.start()
        while not all(ch.done for ch in chains):
            live = [ch for ch in chains if ch.proc is not None]
            select.select(live, [], [], 0.2)
            for ch in live:
                ch.poll()
    finally:
        for ch in chains:
            if ch.proc is not None:
                _kill(ch.proc)
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for ch in chains:
        results.update(ch.results)
    return results


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return _worker(argv[1], argv[2:])
    if argv[:1] == ["run"] and len(argv) == 2:
        sys.path.insert(0, _HERE)
        res = run_tasks(argv[1], tasks_for(argv[1]))
        json.dump([res[k] for k in sorted(res)], sys.stdout, indent=1)
        print()
        return 0
    sys.stderr.write("usage: harness.py run CORPUS_ROOT\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
