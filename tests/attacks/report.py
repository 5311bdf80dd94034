"""Prints the reliability tables of docs/RELIABILITY.md (markdown) from fresh runs.

Usage::

    python tests/attacks/report.py [--trials N] [--sections attacks,flips,dcp]

Sections:

* ``attacks``: every case of the attack corpus through every reader path (see harness.py), one
  row per case: ``typed`` (typed error), ``ok`` / ``ok-wrong`` (succeeded, values bit-exact /
  different), ``untyped``, ``hang``, ``crash``; ``+outside`` when a file outside the case was
  opened, ``+PICKLE`` when the malicious pickle ran.
* ``flips``: N single-byte flips (seeded) in the data files and in the metadata of a pyckpt
  checkpoint and of a DCP ``FileSystemWriter`` checkpoint of the same state dict, each loaded
  back: bit-exact / typed error / other error / silent wrong / crash / hang.
* ``dcp``: DCP ``FileSystemReader`` on the structural attacks that have an equivalent there
  (path traversal in .metadata, data file symlinked outside, FIFO data file and .metadata,
  truncated data file, malicious pickle as .metadata), next to pyckpt's corpus case.

Every trial runs in a subprocess with a deadline (20 s) and the harness's address-space limit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import generate
import harness

_OPS_SHORT = {"load": "load", "dcp_load": "dcp.load", "verify": "verify", "inspect": "inspect",
              "convert": "convert", "consolidate": "consolidate", "st_header": "header"}


def attacks_table() -> str:
    root = tempfile.mkdtemp(prefix="pyckpt-attacks-")
    try:
        generate.generate(root)
        res = harness.run_tasks(root, harness.tasks_for(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ops = list(generate.OPS_PYCKPT)
    lines = ["| case | " + " | ".join(_OPS_SHORT[o] for o in ops) + " | verdict |",
             "|---|" + "---|" * (len(ops) + 1)]
    counts: Counter[str] = Counter()
    for c in generate.CASES:
        cells = []
        bad = False
        for op in ops:
            if c.kind == "pyckpt":
                key = (c.name, op)
            else:
                key = (c.name, {"load": "st_header", "consolidate": "consolidate"}.get(op, ""))
            r = res.get(key)
            if r is None:
                cells.append("")
                continue
            cell = r["outcome"]
            if r["outside"]:
                cell += " +outside"
            if r["marker"]:
                cell += " +PICKLE"
            allowed = {"typed"} | ({"ok"} if key[1] in c.may_pass else set()) | (
                {"untyped"} if key[1] in c.any_error else set())
            if key[1] in c.trusts_pickles:
                cell += " (DCP's default planner: documented)"  # what test_attacks asserts
            elif r["outcome"] not in allowed or r["outside"] or r["marker"]:
                bad = True
                cell = f"**{cell}**"
            counts[r["outcome"]] += 1
            cells.append(cell)
        verdict = "FAIL" if bad else "pass"
        counts[verdict] += 1
        lines.append(f"| `{c.name}` | " + " | ".join(cells) + f" | {verdict} |")
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return ("Safetensors cases: the `load` column is the native header reader, `consolidate` "
            "the CLI; other columns do not apply.\n\n" + "\n".join(lines)
            + f"\n\nTotals: {summary}.\n")


# ------------------------------------------------------------------------------------ flips

_FLIP_WORKER = r"""
import json, os, random, shutil, sys, warnings
sys.path.insert(0, {here!r})
import generate, harness, torch
import torch.distributed.checkpoint as dcp
import pyckpt
warnings.simplefilter("ignore")
kind, src, work, trials, seed, target = sys.argv[1:7]
trials, seed = int(trials), int(seed)
orig = generate.baseline_state_dict()
rng = random.Random(seed)
out = {{}}
for t in range(trials):
    d = os.path.join(work, "t")
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    if target == "meta":
        files = [".metadata" if kind == "dcp" else "pyckpt.json"]
    else:
        files = sorted(f for f in os.listdir(d) if f.endswith(".distcp" if kind == "dcp" else ".pyckpt"))
    f = os.path.join(d, rng.choice(files))
    data = bytearray(open(f, "rb").read())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    open(f, "wb").write(bytes(data))
    sd = generate.load_template()
    try:
        if kind == "dcp":
            dcp.load(sd, storage_reader=dcp.FileSystemReader(d))
        else:
            pyckpt.load(sd, d)
    except BaseException as e:
        inner = harness._unwrap(e)
        res = "typed error" if all(harness._typed(x) for x in inner) else "other error (" + type(inner[0]).__name__ + ")"
    else:
        res = "bit-exact" if harness._same(orig, sd) else "SILENT WRONG"
    out[res] = out.get(res, 0) + 1
print("RESULT " + json.dumps(out))
"""


def _sandboxed(args: list[str], timeout: float) -> tuple[str, str]:
    """Runs python ``args`` with the harness's RLIMIT_AS; returns (status, stdout)."""
    limit = harness.default_as_limit()

    def pre() -> None:
        if limit:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                           timeout=timeout, preexec_fn=pre)
    except subprocess.TimeoutExpired:
        return "hang", ""
    if p.returncode < 0:
        return f"crash (signal {-p.returncode})", p.stdout
    return ("ok" if p.returncode == 0 else f"exit {p.returncode}: {p.stderr[-300:]}"), p.stdout


def _baselines(work: str) -> tuple[str, str]:
    import warnings

    import torch.distributed.checkpoint as dcp

    pk = os.path.join(work, "pyckpt")
    generate._save_baseline(pk)
    dc = os.path.join(work, "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(generate.baseline_state_dict(), storage_writer=dcp.FileSystemWriter(dc))
    return pk, dc


def flips_table(trials: int) -> str:
    work = tempfile.mkdtemp(prefix="pyckpt-flips-")
    script = os.path.join(work, "flip_worker.py")
    with open(script, "w") as f:
        f.write(_FLIP_WORKER.format(here=os.path.dirname(os.path.abspath(__file__))))
    try:
        pk, dc = _baselines(work)
        rows = []
        for target in ("data", "meta"):
            for kind, src in (("pyckpt", pk), ("dcp", dc)):
                wd = os.path.join(work, f"{kind}-{target}")
                os.makedirs(wd)
                status, out = _sandboxed([script, kind, src, wd, str(trials), "1", target],
                                         timeout=60 + trials * 3)
                line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
                cell = (", ".join(f"{k}: {v}" for k, v in sorted(json.loads(line[7:]).items()))
                        if line else status)
                what = "data files" if target == "data" else (
                    "pyckpt.json" if kind == "pyckpt" else ".metadata")
                rows.append(f"| {kind} | {what} | {trials} | {cell} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ("| writer | flipped bytes in | trials | outcomes |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


# ------------------------------------------------------------------------------------ DCP probes

_DCP_WORKER = r"""
import os, sys, warnings
sys.path.insert(0, {here!r})
import generate, harness
import torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
d = sys.argv[1]
w = harness.Watcher()
outside = sys.argv[2]
w.watch(outside)
sd = generate.load_template()
try:
    dcp.load(sd, storage_reader=dcp.FileSystemReader(d))
except BaseException as e:
    inner = harness._unwrap(e)
    res = ("typed" if all(harness._typed(x) for x in inner) else "untyped") + ": " + \
        "; ".join(type(x).__name__ for x in inner)
else:
    res = "ok" if harness._same(generate.baseline_state_dict(), sd) else "ok-wrong"
acc = w.drain()
pwned = os.path.exists(os.path.join(outside, "PWNED"))
print("RESULT " + res + (" +outside" if acc else "") + (" +PICKLE" if pwned else ""))
"""


def _dcp_meta(d: str) -> Any:
    import pickle

    with open(os.path.join(d, ".metadata"), "rb") as f:
        return pickle.load(f)


def _dcp_write_meta(d: str, md: Any) -> None:
    import pickle

    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _dcp_probes(dc: str, work: str, outside: str) -> list[tuple[str, str, str]]:
    """(probe, pyckpt corpus case, builder) -> list of (probe name, case, dir)."""
    out = []

    def fresh(name: str) -> str:
        d = os.path.join(work, name)
        shutil.copytree(dc, d)
        return d

    def data_files(d: str) -> list[str]:
        return sorted(f for f in os.listdir(d) if f.endswith(".distcp"))

    d = fresh("traversal")
    md = _dcp_meta(d)
    name = data_files(d)[0]
    shutil.copyfile(os.path.join(d, name), os.path.join(outside, name))
    os.unlink(os.path.join(d, name))
    rel = os.path.relpath(os.path.join(outside, name), d)  # ../../outside/<name>
    for k, v in md.storage_data.items():
        md.storage_data[k] = type(v)(**{**v.__dict__, "relative_path": rel})
    _dcp_write_meta(d, md)
    out.append(("path traversal in metadata (`../../outside/<data file>`)", "name_traversal_outside", d))

    d = fresh("symlink")
    name = data_files(d)[0]
    tgt = os.path.join(outside, "link-" + name)
    shutil.copyfile(os.path.join(d, name), tgt)
    os.unlink(os.path.join(d, name))
    os.symlink(tgt, os.path.join(d, name))
    out.append(("data file is a symlink outside", "data_symlink_outside", d))

    d = fresh("fifo_data")
    name = data_files(d)[0]
    os.unlink(os.path.join(d, name))
    os.mkfifo(os.path.join(d, name))
    out.append(("data file is a FIFO", "data_fifo", d))

    d = fresh("fifo_meta")
    os.unlink(os.path.join(d, ".metadata"))
    os.mkfifo(os.path.join(d, ".metadata"))
    out.append(("metadata file is a FIFO", "metadata_fifo", d))

    d = fresh("truncated")
    name = data_files(d)[0]
    with open(os.path.join(d, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, name)) // 2)
    out.append(("data file truncated to half", "data_truncated", d))

    d = fresh("truncated_meta")
    with open(os.path.join(d, ".metadata"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, ".metadata")) // 2)
    out.append(("metadata truncated to half", "json_truncated", d))

    d = fresh("pickle_meta")
    import pickle

    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(pickle.dumps(generate._Pwn(os.path.join(outside, "PWNED")), protocol=2))
    out.append(("metadata is a malicious pickle", "malicious_pickle (BYTE_IO item)", d))
    return out


def dcp_table() -> str:
    work = tempfile.mkdtemp(prefix="pyckpt-dcp-")
    outside = os.path.join(work, "outside")
    os.makedirs(outside)
    script = os.path.join(work, "dcp_worker.py")
    with open(script, "w") as f:
        f.write(_DCP_WORKER.format(here=os.path.dirname(os.path.abspath(__file__))))
    root = os.path.join(work, "corpus")
    try:
        _pk, dc = _baselines(work)
        probes = _dcp_probes(dc, os.path.join(work, "probes"), outside)
        case_names = [p[1].split()[0] for p in probes]
        generate.generate(root, names=case_names)
        res = harness.run_tasks(root, [(n, "load") for n in case_names if n in
                                       {c.name for c in generate.CASES}])
        rows = []
        for (probe, case_name, d), short in zip(probes, case_names):
            marker = os.path.join(outside, "PWNED")
            status, out = _sandboxed([script, d, outside], timeout=20)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
            cell = line[7:] if line else status
            if os.path.exists(marker):
                os.unlink(marker)
            r = res.get((short, "load"))
            pk = "" if r is None else r["outcome"] + (" +outside" if r["outside"] else "") + (
                " +PICKLE" if r["marker"] else "")
            rows.append(f"| {probe} | {cell} | `{case_name}`: {pk} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ("| probe | DCP FileSystemReader (dcp.load) | pyckpt.load, corpus case |\n|---|---|---|\n"
            + "\n".join(rows) + "\n")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=200, help="byte flips per row")
    ap.add_argument("--sections", default="attacks,flips,dcp")
    args = ap.parse_args(argv)
    random.seed(0)
    sections = args.sections.split(",")
    if "attacks" in sections:
        print("## Attack corpus\n")
        print(attacks_table())
    if "flips" in sections:
        print("## Byte flips\n")
        print(flips_table(args.trials))
    if "dcp" in sections:
        print("## Structural attacks: DCP FileSystemReader vs pyckpt\n")
        print(dcp_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
