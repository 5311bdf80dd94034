"""The process's host cache: a new Writer per checkpoint (the README's pattern) starts on the
pages the previous Writer faulted in, the bound comes from ``PYCKPT_HOST_CACHE_BYTES``, and
reused (uninitialised) memory never shows through in what is saved or exported.

Each case runs in a fresh interpreter: the cache is process state. Page faults are counted by
the kernel (``ru_minflt``), not timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _child_env import child_env

_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch
    import pyckpt
    from pyckpt import _C
    from safetensors.torch import load_file

    root = sys.argv[1]
    def state(seed):
        g = torch.Generator().manual_seed(seed)
        return {f"model.layers.{i}.weight": (torch.randn(1024, 1024, generator=g) * 0.02)
                .to(torch.bfloat16) for i in range(8)}  # 16 MiB

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    out = {}
    try:
        sds = [state(s) for s in range(3)]
        counts = []
        for i, sd in enumerate(sds):  # a new Writer per save, as the README writes it
            f0 = faults()
            pyckpt.save(sd, os.path.join(root, f"c{i}"), compression="zstd")
            counts.append(faults() - f0)
        out["save_faults"] = counts
        out["cache"] = _C.host_cache_info()
        exact = True
        for i, sd in enumerate(sds):  # each save holds its own bytes, none of an earlier one's
            back = {k: torch.empty_like(v) for k, v in sd.items()}
            pyckpt.load(back, os.path.join(root, f"c{i}"))
            exact = exact and all(torch.equal(back[k], sd[k]) for k in sd)
            pyckpt.consolidate(os.path.join(root, f"c{i}"), os.path.join(root, f"hf{i}"),
                               fsync=False)
            hf = load_file(os.path.join(root, f"hf{i}", "model-00001-of-00001.safetensors"))
            exact = exact and all(torch.equal(hf[k], sd[k]) for k in sd)
        out["exact"] = exact
    except Exception as e:
        out["error"] = type(e).__name__ + ": " + str(e)
    print("RESULT " + json.dumps(out))
    """
)


def _run(tmp_path, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
        timeout=300, env=child_env(**env), check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_a_new_writer_per_save_reuses_the_previous_writers_memory(tmp_path):
    cached = _run(tmp_path / "cached")
    uncached = _run(tmp_path / "uncached", PYCKPT_HOST_CACHE_BYTES="0")
    assert "error" not in cached and "error" not in uncached, (cached, uncached)
    assert cached["exact"] and uncached["exact"]
    assert cached["cache"]["limit"] == 128 << 20
    assert 0 < cached["cache"]["bytes"] <= 128 << 20
    assert uncached["cache"] == {"bytes": 0, "limit": 0}
    # Saves 2 and 3 fault in far fewer pages when the first Writer's blocks were kept (their
    # encode and O_DIRECT blocks, ~40 MiB of fresh memory per save without the cache).
    # (Measured: ~3,500 against ~10,600 pages over saves 2 and 3.)
    assert sum(cached["save_faults"][1:]) * 2 < sum(uncached["save_faults"][1:]), (
        cached["save_faults"], uncached["save_faults"])


def test_a_bad_bound_is_refused_naming_the_variable(tmp_path):
    res = _run(tmp_path, PYCKPT_HOST_CACHE_BYTES="-1")
    assert res["error"].startswith("ValueError: PYCKPT_HOST_CACHE_BYTES='-1' must be >= 0"), res
