"""The layering rules of pyckpt/, checked on the source (no import of pyckpt needed).

- No import cycle between pyckpt's modules, counting imports inside functions (a lazy import
  is still a dependency).
- cli.py imports only public modules (no ``pyckpt._x``).
- No file under pyckpt/ is longer than :data:`MAX_LINES` lines.
- Only the backend selection module and the backends read URL schemes or branch on the
  node-local choice: ``is_url(``, the literal ``"s3://"`` and ``shared_filesystem`` in a
  condition appear nowhere else.
- Threads are started only by the owner module of their model (docs/ARCHITECTURE.md,
  "Threads"), and the native layer has one progress counter type.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "pyckpt"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """pyckpt modules imported anywhere in ``path`` (top level or inside functions), excluding
    imports needed only for type checking."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    type_only.add(id(inner))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # The longest pyckpt module the import names (``from pyckpt import _C`` names the
            # package and, if it is one, the submodule).
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a list of modules, or None. Importing a module imports its parent
    packages first, but a package's ``__init__`` importing its own submodule is not a cycle."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if n.startswith(m + "."):  # a submodule "importing" its parent package: not an edge
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "pyckpt.backends.s3" in graph["pyckpt.storage"] or any(
        m.startswith("pyckpt.backends") for m in graph["pyckpt.storage"])
    assert "pyckpt._consolidate.staged" in graph["pyckpt._consolidate"]


def test_no_import_cycle_in_pyckpt() -> None:
    assert _cycle(_graph()) is None


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _cycle(graph) in (["a", "b", "c", "a"],)
    assert _cycle({"p": {"p.x"}, "p.x": {"p"}}) is None  # package <-> its submodule


def test_cli_imports_only_public_modules() -> None:
    private = sorted(m for m in _graph()["pyckpt.cli"]
                     if any(part.startswith("_") for part in m.split(".")[1:]))
    assert private == []


# Modules allowed to look at URL schemes and the node-local choice.
_SELECTION = ("pyckpt.backends",)


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname == "is_url":
                out.append(f"{path.name}:{node.lineno}: is_url(")
        elif isinstance(node, ast.Constant) and node.value == "s3://":
            out.append(f"{path.name}:{node.lineno}: \"s3://\"")
        elif isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            if "shared_filesystem" in ast.unparse(node.test):
                out.append(f"{path.name}:{node.lineno}: branch on shared_filesystem")
        elif isinstance(node, ast.Compare) and "shared_filesystem" in ast.unparse(node):
            out.append(f"{path.name}:{node.lineno}: comparison of shared_filesystem")
    return out


# Integrations map a framework's own options (torchtitan's checkpoint folder, local or remote,
# shared by the nodes or not) onto pyckpt's arguments, so they may branch on that choice; the
# core below them never does.
_FRAMEWORK_ADAPTERS = "pyckpt.integrations"


def test_url_schemes_and_node_local_choice_only_in_the_backends() -> None:
    offences = []
    for name, path in _modules().items():
        if any(name == top or name.startswith(top + ".")
               for top in (_SELECTION[0], _FRAMEWORK_ADAPTERS)):
            continue
        offences += _offences(path)
    assert offences == []


def test_the_scheme_check_finds_offences(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('if is_url(p) or p.startswith("s3://"):\n    pass\n'
                   "x = 1 if shared_filesystem else 2\n")
    assert len(_offences(bad)) == 3


# The checkpoint manager reaches its tiers only through backend objects (a tier is a location
# with a backend): no URL test, no string starting with "scheme://" (docstrings may name
# them), no import of one backend's client.
_TIER_MODULES = ("pyckpt._tier_io", "pyckpt.manager", "pyckpt._replicate", "pyckpt._manager")
_URL_FUNCTIONS = {"is_url", "is_remote", "scheme_of"}


def _tier_offences(path: Path, imports: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = _offences(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname in _URL_FUNCTIONS:
                out.append(f"{path.name}:{node.lineno}: {fname}(")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and re.match(r"([A-Za-z][A-Za-z0-9+.-]*)?://", node.value):
            out.append(f"{path.name}:{node.lineno}: {node.value!r}")
    out += [f"{path.name}: imports {m}" for m in sorted(imports)
            if m.startswith(("pyckpt.backends.s3", "pyckpt.backends.memory",
                             "pyckpt.backends.peer"))]
    return out


def test_the_manager_reaches_its_tiers_only_through_backends() -> None:
    modules, graph = _modules(), _graph()
    offences = []
    for name in modules:
        if name in _TIER_MODULES or name.startswith("pyckpt._manager."):
            offences += _tier_offences(modules[name], graph[name])
    assert offences == []


def test_the_tier_check_finds_offences(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Docs may say s3://bucket."""\n'
                   'if is_remote(p) or scheme_of(p) or p.startswith("memory://"):\n'
                   '    u = f"s3://{p}"\n')
    # is_remote(, scheme_of(, "memory://", "s3://" (twice: here and in _offences), the import
    assert len(_tier_offences(bad, {"pyckpt.backends.s3.client"})) == 6


# Backends side by side behind one protocol (issue 44 item 1): above the seam no module names
# a place's kind (the old ``local_dir`` / ``node_local`` attributes, a concrete backend class,
# an ``isinstance`` against one) or imports a concrete backend; what the layers above need to
# know is a method or property of ``pyckpt.backends.base.Backend``. Each backend imports only
# the protocol (and modules below the seam), never another backend.
_SEAM = "pyckpt.backends"
_PROTOCOL_MODULES = {"pyckpt.backends", "pyckpt.backends.base"}
_PLACE_ATTRIBUTES = {"local_dir", "node_local"}
_BACKEND_CLASSES = {"PosixBackend", "PeerBackend", "S3Backend", "MemoryBackend"}


def _concrete(module: str) -> bool:
    return module.startswith(_SEAM + ".") and module not in _PROTOCOL_MODULES


def _backend_of(module: str) -> str:
    """The backend a module of ``pyckpt.backends`` belongs to (``s3`` for ``s3.client``)."""
    return module[len(_SEAM) + 1:].split(".")[0]


def _place_offences(path: Path, imports: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = [f"{path.name}: imports {m}" for m in sorted(imports) if _concrete(m)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _PLACE_ATTRIBUTES:
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in _PLACE_ATTRIBUTES:
            out.append(f"{path.name}:{node.lineno}: {node.value!r}")  # getattr(b, "local_dir")
        elif isinstance(node, ast.Name) and node.id in _BACKEND_CLASSES:
            out.append(f"{path.name}:{node.lineno}: {node.id}")
    return out


def test_no_place_branching_or_concrete_backend_above_the_seam() -> None:
    modules, graph = _modules(), _graph()
    offences = []
    for name, path in modules.items():
        if name == _SEAM or name.startswith(_SEAM + "."):
            continue
        offences += _place_offences(path, graph[name])
    assert offences == []


def test_the_place_check_finds_offences(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("if b.local_dir is None or getattr(b, 'node_local', False):\n"
                   "    x = isinstance(b, PeerBackend)\n")
    assert len(_place_offences(bad, {"pyckpt.backends.s3.upload", "pyckpt.backends.base"})) == 4


def test_backends_import_only_the_protocol() -> None:
    graph = _graph()
    offences = []
    for name, imports in graph.items():
        if not _concrete(name):
            continue
        offences += [f"{name} imports {m}" for m in sorted(imports)
                     if _concrete(m) and _backend_of(m) != _backend_of(name)]
    assert offences == []


# A file longer than this is split by subsystem (docs/ARCHITECTURE.md names where each lives).
MAX_LINES = 700


def _long_files(root: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        with path.open("rb") as f:
            n = sum(1 for _ in f)
        if n > limit:
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
    return out


def test_no_file_in_pyckpt_is_over_the_line_limit() -> None:
    assert _long_files(PKG, MAX_LINES) == []


def test_the_line_limit_check_finds_long_files(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "short.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _long_files(pkg, MAX_LINES) == [f"pkg/long.py: {MAX_LINES + 1} lines"]


# The thread models (docs/ARCHITECTURE.md, "Threads"): what starts threads (a call, or a base
# class) -> the only modules that may use it. Native workers: _native; Python-side background
# work: _background; daemons with the exit discipline: _daemons; the progress poller (over the
# one native counter type): _progress.
_THREAD_STARTERS = {
    "ThreadPool": {"pyckpt._native"},
    "ThreadPoolExecutor": {"pyckpt._background"},
    "ProcessPoolExecutor": set(),
    "Thread": {"pyckpt._daemons", "pyckpt._progress"},
    "Timer": set(),
    "start_new_thread": set(),
    "ProgressCounter": {"pyckpt._progress"},
}
# C++ files that may start threads: the pool itself, the POSIX writer's I/O thread, the two
# native fan-outs that size a pool from their caller's thread count (stitch, block digests),
# and the test double of the CUDA runtime.
_NATIVE_THREAD_FILES = {
    "core/thread_pool.hpp", "core/thread_pool.cpp", "core/posix_storage.cpp",
    "core/stitcher.cpp", "core/checksum.cpp", "testing/fake_cudart.cpp",
}
CSRC = PKG.parent / "csrc"


def _thread_offences(path: Path, name: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            exprs = [node.func]
        elif isinstance(node, ast.ClassDef):
            exprs = list(node.bases)
        else:
            continue
        for e in exprs:
            what = e.attr if isinstance(e, ast.Attribute) else getattr(e, "id", "")
            if what in _THREAD_STARTERS and name not in _THREAD_STARTERS[what]:
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(e)}")
    return out


def test_threads_are_started_only_by_their_models_owner() -> None:
    offences = []
    for name, path in _modules().items():
        offences += _thread_offences(path, name)
    assert offences == []


def test_the_thread_check_finds_offences(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import threading\n"
                   "from concurrent.futures import ThreadPoolExecutor\n"
                   "pool = _C.ThreadPool(2)\n"
                   "ex = ThreadPoolExecutor(4)\n"
                   "t = threading.Thread(target=print)\n"
                   "class Worker(threading.Thread):\n"
                   "    pass\n")
    assert len(_thread_offences(bad, "pyckpt.bad")) == 4
    assert len(_thread_offences(bad, "pyckpt._background")) == 3


def test_native_threads_start_only_in_their_files() -> None:
    starts = re.compile(r"std::thread\s*\(|std::thread\s+\w+|std::async|pthread_create|"
                        r"\bThreadPool\s+\w+\s*[({]")
    found = set()
    for path in sorted(CSRC.rglob("*.[ch]pp")):
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        if starts.search(code):
            found.add(path.relative_to(CSRC).as_posix())
    assert found - _NATIVE_THREAD_FILES == set()
    assert "core/posix_storage.cpp" in found  # the pattern does find thread starts


def test_one_native_progress_counter_type() -> None:
    stub = (PKG / "_C.pyi").read_text()
    assert re.findall(r"^class (\w*Progress\w*)", stub, re.M) == ["ProgressCounter"]
