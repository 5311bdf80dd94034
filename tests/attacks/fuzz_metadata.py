"""Structure-aware fuzzing of pyckpt.json (run as a worker by tests/test_fuzz_metadata.py).

Usage::

    python tests/attacks/fuzz_metadata.py WORKDIR SECONDS SEED

Starts from a real checkpoint, then repeatedly applies 1-3 random structural mutations to its
metadata document -- set a value (to a boundary integer, float, bool, null, string, container or
a nudged copy of the old value), delete a key or list element, duplicate a key (the copy holding
a different value, in either order), retype a value -- writes it with a valid checksum
(``generate.write_metadata``), and runs the readers:

* ``_format.read_index`` must return or raise a typed error (PyckptError / OSError);
* the metadata reader and the Python validator kept as its oracle (tests/_index_oracle.py) must
  read the document alike: the same index, or the same error and message;
* when it returns, ``pyckpt.load`` must either raise a typed error or load values bit-identical to
  the original (never a silently different result).

Each iteration runs under a watchdog (``faulthandler``: a stuck iteration dumps the stacks and
exits with status 70) and the whole worker under ``RLIMIT_AS`` (4 GiB). Findings are printed as
JSON lines ``FINDING {...}`` (with the mutations, so they reproduce); the exit status is 0 when
there were none, 1 otherwise.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import random
import shutil
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import generate
from _docwalk import get, paths

_INTS = [0, 1, -1, 2, 3, 7, 8, 255, 4096, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
         2**64, 2**100]
_ATOMS: list[Any] = [0.0, 1.0, 0.5, -0.0, 1e308, True, False, None, "", "x", "../x",
                     "/etc/passwd", "\u0660", "zstd", "none", "group", "group_rotl1", "float32",
                     "uint8", "tensor", "bytes", [], {}, [0], [0, 0], {"__tuple__": 1},
                     {"__tuple__": []}]


def _value(rng: random.Random, old: Any) -> Any:
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.4:
        return rng.choice([old + 1, old - 1, old * 2, old ^ (1 << rng.randrange(64)), -old,
                           old + 4096])
    if r < 0.7:
        return rng.choice(_INTS)
    return copy.deepcopy(rng.choice(_ATOMS))


def mutate(doc: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], list[str], Any]:
    """Applies 1-3 mutations; returns (doc, descriptions, duplicate) where duplicate is None or
    (object path, key, extra value, extra_first) for the serializer."""
    doc = copy.deepcopy(doc)
    desc: list[str] = []
    dup = None
    for _ in range(rng.randint(1, 3)):
        where = [p for p in paths(doc) if p]
        path = rng.choice(where)
        parent, key = get(doc, path[:-1]), path[-1]
        kind = rng.choice(["set", "set", "set", "delete", "duplicate", "retype"])
        if kind == "set":
            new = _value(rng, parent[key])
            desc.append(f"set {list(path)} = {new!r}")
            parent[key] = new
        elif kind == "delete":
            desc.append(f"delete {list(path)}")
            del parent[key]
        elif kind == "duplicate" and isinstance(parent, dict) and dup is None:
            extra = _value(rng, parent[key])
            first = rng.random() < 0.5
            desc.append(f"duplicate key {list(path)} with {extra!r} {'before' if first else 'after'}")
            dup = (path[:-1], key, extra, first)
        else:
            old = parent[key]
            new = ([old] if not isinstance(old, list) else {"v": old}) if rng.random() < 0.5 \
                else json.dumps(old)
            desc.append(f"retype {list(path)} -> {type(new).__name__}")
            parent[key] = new
    return doc, desc, dup


def serialize(doc: Any, dup: Any, path: tuple[Any, ...] = ()) -> str:
    """Compact JSON; emits the duplicate key of ``dup`` in the object at its path."""
    if isinstance(doc, dict):
        parts = []
        for k, v in doc.items():
            item = json.dumps(k, ensure_ascii=False) + ":" + serialize(v, dup, path + (k,))
            if dup is not None and dup[0] == path and dup[1] == k:
                extra = json.dumps(k, ensure_ascii=False) + ":" + json.dumps(dup[2])
                parts += [extra, item] if dup[3] else [item, extra]
            else:
                parts.append(item)
        return "{" + ",".join(parts) + "}"
    if isinstance(doc, list):
        return "[" + ",".join(serialize(v, dup, path + (i,)) for i, v in enumerate(doc)) + "]"
    return json.dumps(doc, ensure_ascii=False)


def main(argv: list[str]) -> int:
    workdir, seconds, seed = argv[0], float(argv[1]), int(argv[2])
    limit = int(float(os.environ.get("PYCKPT_ATTACK_AS_GIB", "4")) * 2**30)
    if limit and not os.environ.get("ASAN_OPTIONS"):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from _index_compare import both_readers
    from harness import _same, _typed

    import pyckpt
    from pyckpt import _format

    base = os.path.join(workdir, "base")
    generate._save_baseline(base)
    original = generate.baseline_state_dict()
    doc0 = generate.read_metadata(base)
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    n = findings = loaded = 0
    ckpt = os.path.join(workdir, "ckpt")
    while time.monotonic() < deadline:
        n += 1
        doc, desc, dup = mutate(doc0, rng)
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(base, ckpt)
        try:
            body = serialize(doc, dup).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError):
            continue
        generate.write_metadata_raw(ckpt, body)
        print(f"ITER {n} {json.dumps(desc)}", flush=True)
        faulthandler.dump_traceback_later(20, exit=True)
        problem = None
        try:
            with open(os.path.join(ckpt, _format.METADATA_FILE), "rb") as f:
                native, reference = both_readers(f.read())
            if native != reference:
                problem = f"the metadata reader gave {native[:3]!r:.200}, the Python validator " \
                          f"{reference[:3]!r:.200}"
            try:
                _format.read_index(ckpt)
            except Exception as e:
                if not _typed(e):
                    problem = f"read_index raised {type(e).__name__}: {str(e)[:300]}"
            else:
                sd = generate.load_template()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        pyckpt.load(sd, ckpt)
                except Exception as e:
                    # A mutation that deletes a whole item leaves a valid checkpoint without that
                    # key; DCP itself refuses to load a key the checkpoint lacks (documented in
                    # pyckpt.load).
                    missing = isinstance(e, RuntimeError) and str(e).startswith(
                        "Missing key in checkpoint state_dict")
                    if not _typed(e) and not missing:
                        problem = f"load raised {type(e).__name__}: {str(e)[:300]}"
                else:
                    loaded += 1
                    if not _same(original, sd):
                        problem = "load returned values that differ from the original"
        finally:
            faulthandler.cancel_dump_traceback_later()
        if problem:
            findings += 1
            print("FINDING " + json.dumps({"iteration": n, "seed": seed, "mutations": desc,
                                           "problem": problem}), flush=True)
    print(f"DONE {n} iterations, {loaded} loaded, {findings} findings", flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
