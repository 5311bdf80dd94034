"""Structure-aware fuzzing of pyckpt.json and the metadata shards (run as a worker by
tests/test_fuzz_metadata.py).

Usage::

    python tests/attacks/fuzz_metadata.py WORKDIR SECONDS SEED

Starts from real checkpoints, then repeatedly applies 1-3 random structural mutations to a
metadata document -- set a value (to a boundary integer, float, bool, null, string, container or
a nudged copy of the old value), delete a key or list element, duplicate a key (the copy holding
a different value, in either order), retype a value -- writes it with a valid checksum
(``generate.write_metadata_raw``), and runs the readers. The iterations take turns among three
targets:

* ``v3``: the pyckpt.json of a checkpoint of the default format (``generate._save_baseline``);
* ``v4-global``: the global pyckpt.json of a version-4 checkpoint (``metadata_shards=True``, see
  docs/FORMAT.md, "Version 4: metadata shards");
* ``v4-shard``: that checkpoint's metadata shard, parsed from the end of its data file. The
  mutated shard is sealed and written back in place of the old one, and pyckpt.json gets the
  data file's new size and the shard's new length and XXH64, so the checks behind the digest are
  the ones exercised; one time in five the digest is left stale (the digest check itself).

Checks:

* ``_format.read_index`` must return or raise a typed error (PyckptError / OSError), and must
  not return on a document that repeats a key (docs/FORMAT.md, "Encoding");
* ``v3`` only: the metadata reader and the Python validator kept as its oracle
  (tests/_index_oracle.py, which covers versions 1-3) must read the document alike: the same
  index, or the same error and message;
* when it returns, ``pyckpt.load`` must either raise a typed error or load values bit-identical to
  the original (never a silently different result). So must a load of a version-4 checkpoint
  whose global document is valid when ``read_index`` refuses it: a load reads only what it needs
  of the shards, ``read_index`` all of them.

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
                     "uint8", "tensor", "bytes", [], {}, [0], [0, 0], [0, {"k": 0}],
                     {"__tuple__": 1}, {"__tuple__": []}]


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


class _Repeated(Exception):
    pass


def _repeats_key(body: bytes) -> bool:
    """True when the JSON text ``body`` repeats a key in some object (the duplicate a mutation
    asked for may be gone, its object deleted or replaced by a later mutation)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise _Repeated
        return dict(pairs)

    try:
        json.loads(body, object_pairs_hook=hook)
    except _Repeated:
        return True
    except (ValueError, RecursionError):
        pass
    return False


def _global_ok(ckpt: str) -> bool:
    """True when the checkpoint's pyckpt.json is a version-4 global document that
    ``parse_global`` accepts (a load reads it as ``read_index`` does, then goes its own way)."""
    from pyckpt import _format_shards, _format_shards_read

    with open(os.path.join(ckpt, generate._META), "rb") as f:
        raw = f.read()
    try:
        _format_shards_read.parse_global(raw, ckpt)
    except Exception:  # read_index has reported it if it is untyped
        return False
    return _format_shards.is_sharded(raw)


def _save_sharded_baseline(ckpt: str) -> None:
    """``generate._save_baseline``, written as version 4 (one rank, one metadata shard)."""
    import pyckpt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pyckpt.save(generate.baseline_state_dict(), ckpt, compression="zstd",
                    chunk_bytes=generate._CHUNK, fsync=False, metadata_shards=True)
    doc = generate.read_metadata(ckpt)
    if doc.get("version") != 4 or len(doc.get("shards", ())) != 1:
        raise RuntimeError(f"{ckpt}: the sharded baseline is not a one-shard version-4 checkpoint")


def _write_shard(ckpt: str, doc4: dict[str, Any], prefix: bytes, body: bytes,
                 stale: bool) -> None:
    """Seals ``body`` as the shard of the version-4 checkpoint ``ckpt`` (its data file:
    ``prefix`` + the shard) and rewrites pyckpt.json (``doc4``) with the shard's length and
    digest (the old digest when ``stale``)."""
    from pyckpt import _C

    new = _C.zstd_frame(generate.seal(body))  # as the writer stores it
    doc = copy.deepcopy(doc4)
    entry = doc["shards"][0]
    with open(os.path.join(ckpt, generate.shard_file(doc, entry)), "wb") as f:
        f.write(prefix + new)
    entry[2] = len(new)
    if not stale:
        entry[3] = _C.xxh64(new)
    generate.write_metadata(ckpt, doc)


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
    base4 = os.path.join(workdir, "base4")
    _save_sharded_baseline(base4)
    original = generate.baseline_state_dict()
    doc0 = generate.read_metadata(base)
    doc4 = generate.read_metadata(base4)
    with open(os.path.join(base4, generate.shard_file(doc4, doc4["shards"][0])), "rb") as f:
        data = f.read()
    shard_offset = doc4["shards"][0][1]
    prefix, shard0 = data[:shard_offset], json.loads(generate.shard_text(data[shard_offset:]))
    shard0.pop("checksum")
    targets = ("v3", "v4-global", "v4-shard")
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    n = findings = 0
    runs, loaded = dict.fromkeys(targets, 0), dict.fromkeys(targets, 0)
    ckpt = os.path.join(workdir, "ckpt")
    while time.monotonic() < deadline:
        n += 1
        target = targets[n % len(targets)]
        doc, desc, dup = mutate(shard0 if target == "v4-shard" else doc4
                                if target == "v4-global" else doc0, rng)
        stale = target == "v4-shard" and rng.random() < 0.2
        if stale:
            desc.append("digest left stale")
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(base if target == "v3" else base4, ckpt)
        try:
            body = serialize(doc, dup).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError):
            continue
        if target == "v4-shard":
            _write_shard(ckpt, doc4, prefix, body, stale)
        else:
            generate.write_metadata_raw(ckpt, body)
        runs[target] += 1
        print(f"ITER {n} {target} {json.dumps(desc)}", flush=True)
        faulthandler.dump_traceback_later(20, exit=True)
        problem = None
        try:
            if target == "v3":  # the oracle covers versions 1-3
                with open(os.path.join(ckpt, _format.METADATA_FILE), "rb") as f:
                    native, reference = both_readers(f.read())
                if native != reference:
                    problem = f"the metadata reader gave {native[:3]!r:.200}, the Python " \
                              f"validator {reference[:3]!r:.200}"
            read = False
            try:
                _format.read_index(ckpt)
                read = True
            except Exception as e:
                if not _typed(e):
                    problem = f"read_index raised {type(e).__name__}: {str(e)[:300]}"
            if read and dup is not None and _repeats_key(body):
                problem = "read_index accepted a document that repeats a key"
            # A version-4 load reads the global document, then only what it needs of the shards
            # (read_index reads all): it must hold up on a checkpoint refused for its shard too.
            if read or (target != "v3" and _global_ok(ckpt)):
                sd = generate.load_template()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        pyckpt.load(sd, ckpt)
                except Exception as e:
                    # A mutation that deletes a whole item leaves a valid checkpoint without that
                    # key; DCP itself refuses to load a key the checkpoint lacks (documented in
                    # pyckpt.load). Likewise a tensor whose shape a version-4 global document
                    # changes consistently (shape and grid): the planner refuses the size
                    # mismatch, as DCP's does, before any shard is read.
                    planner_refused = isinstance(e, RuntimeError) and str(e).startswith(
                        "Missing key in checkpoint state_dict") or isinstance(
                        e, ValueError) and str(e).startswith("Size mismatch between saved ")
                    if not _typed(e) and not planner_refused:
                        problem = problem or f"load raised {type(e).__name__}: " \
                                             f"{str(e)[:300]}"
                else:
                    loaded[target] += 1
                    if not _same(original, sd):
                        problem = problem or "load returned values that differ from " \
                                             "the original"
        finally:
            faulthandler.cancel_dump_traceback_later()
        if problem:
            findings += 1
            print("FINDING " + json.dumps({"iteration": n, "seed": seed, "target": target,
                                           "mutations": desc, "problem": problem}), flush=True)
    print(f"DONE {n} iterations, {sum(loaded.values())} loaded, {findings} findings ("
          + ", ".join(f"{t}: {runs[t]} run, {loaded[t]} loaded" for t in targets) + ")",
          flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
