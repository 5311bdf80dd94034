"""The end-to-end demo (examples/train.py, run by scripts/demo.sh) at its test size.

Two gloo worker processes ("nodes" 0 and 1) train a tiny Llama with FSDP2 and checkpoint with
pyckpt.CheckpointManager (fast tier per node with a replica on the other node, durable tier
every few saves); node 1 is SIGKILLed and its fast tier deleted, both restart and restore the
newest fast-tier step, node 1's bytes coming from node 0's replicas and none from the durable
tier; the model is exported with pyckpt.consolidate and loaded with transformers. The demo's
own checks (bit-identical losses as float hex, identical logits) must pass, and it must leave a
valid PNG plot behind.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from _png import png_size

pytest.importorskip("transformers", reason="the demo needs transformers (pip install 'pyckpt[demo]')")
pytest.importorskip("matplotlib", reason="the demo needs matplotlib (pip install 'pyckpt[demo]')")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _demo_module():
    name = "_pyckpt_train_demo"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_trains_crashes_resumes_bit_identically_and_exports(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "tiny", "--workdir", str(work), "--no-progress",
         "--timeout", "300"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ),
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.splitlines()[-2:] == [
        "resumed bit-identical: yes",
        "export loads in transformers: yes",
    ], out
    # Node 1 was lost after step 10 (fast tier: steps 6 and 9; durable: step 6) and the restart
    # restored step 9 from the fast tier: node 1 read nothing locally, every byte from node 0's
    # replicas, and no rank read a byte from the durable tier.
    assert "node 1 held fast-tier steps [6, 9] (its own files and node 0's replicas); durable " \
           "tier: steps [6]" in out, out
    assert "node 1 SIGKILLed after step 10; its fast tier deleted" in out, out
    sources = dict(re.findall(r"^restore sources, rank (\d) \(node \d\): (.*)$", out, re.M))
    assert sorted(sources) == ["0", "1"], out
    m0 = re.fullmatch(r"local (\d+) B, peer 0 B, durable 0 B \(fast tier\)", sources["0"])
    m1 = re.fullmatch(r"local 0 B, peer (\d+) B, durable 0 B \(fast tier\)", sources["1"])
    assert m0 and int(m0.group(1)) > 0 and m1 and int(m1.group(1)) > 0, sources
    assert "durable bytes read: 0" in out.splitlines(), out
    summary = json.loads((work / "summary.json").read_text())
    assert summary["kill_at"] == 10 and summary["resumed_from"] == 9
    assert summary["durable_newest_at_kill"] == 6 and summary["durable_bytes_read"] == 0
    assert summary["restore_sources"]["1"] == {
        "tier": "fast", "bytes_local": 0, "bytes_peer": int(m1.group(1)), "bytes_durable": 0}
    assert summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert summary["logits_max_abs_diff"] == 0.0
    # Figures were measured, not invented: one stall per save step per method, real sizes.
    assert summary["stall_steps"] == [3, 6, 9, 12]
    stalls = summary["stall_manager_s"] + summary["stall_pyckpt_s"] + summary["stall_dcp_s"]
    assert len(stalls) == 12 and all(s > 0 for s in stalls)
    assert summary["bytes_step"] == 12 and summary["bytes_pyckpt"] > 0 and summary["bytes_dcp"] > 0
    assert (work / "ref" / "durable" / "step-12" / "pyckpt.json").is_file()
    # Every export was timed EXPORT_REPEATS times after the first; the table shows the medians.
    runs = summary["export_runs_s"]
    assert sorted(runs) == ["pyckpt", "pyckpt_shards", "torch"], runs
    repeats = _demo_module().EXPORT_REPEATS
    assert all(len(v) == repeats and all(t > 0 for t in v) for v in runs.values()), runs
    assert summary["export_pyckpt_s"] == statistics.median(runs["pyckpt"])
    assert summary["export_torch_s"] == statistics.median(runs["torch"])
    # torch's step runs to the barrier after its call (as pyckpt's ends when every rank has
    # heard the commit); its call alone on rank 0 is kept, and is part of that step.
    calls = summary["export_torch_call_runs_s"]
    assert len(calls) == repeats and summary["export_torch_call_s"] == statistics.median(calls)
    assert all(0 < c <= t for c, t in zip(calls, runs["torch"])), (calls, runs["torch"])
    assert 0 < summary["export_first_torch_call_s"] <= summary["export_first_torch_s"]
    assert summary["export_first_pyckpt_s"] > 0 and summary["export_save_torch_s"] > 0
    # The export is standard Hugging Face safetensors plus the config.json the demo wrote.
    hf = work / "export" / "hf"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors.index.json").is_file()
    assert f"plot: {work / 'demo.png'}" in out
    width, height = png_size(work / "demo.png")
    assert width >= 600 and height >= 400


def test_losses_match_is_bit_exact() -> None:
    demo = _demo_module()
    ref = {s: float(1.0 + s / 7).hex() for s in range(1, 9)}
    run = {s: ref[s] for s in range(5, 9)}
    assert demo.losses_match(ref, run, range(5, 9))
    one_ulp = dict(run)
    one_ulp[7] = math.nextafter(float.fromhex(run[7]), math.inf).hex()
    assert not demo.losses_match(ref, one_ulp, range(5, 9))
    assert not demo.losses_match(ref, {s: run[s] for s in (5, 6, 8)}, range(5, 9))  # a gap
    assert not demo.losses_match(ref, {}, [])  # nothing logged is not a pass
    assert not demo.losses_match({s: ref[s] for s in range(1, 7)}, run, range(5, 9))


def test_expected_resume_is_the_newest_fast_tier_step() -> None:
    demo = _demo_module()
    tiny = demo.SIZES["tiny"]
    assert demo.expected_resume(tiny) == (9, 6)
    assert demo.expected_resume(demo.SIZES["small"]) == (45, 40)
    assert demo.expected_resume(demo.dataclasses.replace(tiny, kill_at=6)) == (6, 6)


def _summary() -> dict:
    losses = {s: float(2.0 - s / 20).hex() for s in range(1, 13)}
    return {
        "params": 1.5e6, "save_every": 4, "persist_every": 8, "kill_at": 9, "resumed_from": 8,
        "stall_steps": [4, 8, 12], "stall_manager_s": [0.010, 0.012, 0.011],
        "stall_pyckpt_s": [0.009, 0.011, 0.010], "stall_dcp_s": [0.050, 0.040, 0.060], "bytes_step": 12, "bytes_pyckpt": 12 << 20,
        "bytes_dcp": 18 << 20, "bytes_raw": 18 << 20, "load_pyckpt_s": 0.8, "load_dcp_s": 1.6,
        "export_pyckpt_s": 0.02, "export_torch_s": 0.03, "export_pyckpt_shards_s": 0.015,
        "export_runs_s": {"pyckpt": [0.02] * 5, "pyckpt_shards": [0.015] * 5,
                          "torch": [0.03] * 5},
        "export_bytes": 6 << 20,
        "losses": {"reference": losses, "crash": {s: losses[s] for s in range(1, 8)},
                   "resume": {s: losses[s] for s in range(5, 13)}},
    }


def test_demo_plot_marks_kill_and_resume_labels_stalls_and_separates_export(
        tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    demo = _demo_module()
    fig = demo._figure(_summary())
    try:
        by_title = {ax.get_title().split(" (")[0].split("\n")[0]: ax for ax in fig.axes}
        loss = by_title["training loss"]
        legend = [t.get_text() for t in loss.get_legend().get_texts()]
        assert "node 1 lost after step 9 (SIGKILL, fast tier deleted)" in legend
        assert "resumed from step 8 (fast tier: peers' replicas)" in legend
        stall = by_title["training stall per save"]
        assert "3 saves, 1 run each" in stall.get_title()
        assert "above each group: DCP / manager" in stall.get_title()
        texts = [t.get_text() for t in stall.texts if t.get_text().endswith("x")]
        assert texts == ["5.00x", "3.33x", "5.45x"]
        labels = {t.get_text() for t in stall.texts}  # bar_label adds Annotations to texts
        assert {"10.0", "9.0", "50.0", "60.0"} <= labels  # every bar carries its value
        legend = [t.get_text() for t in stall.get_legend().get_texts()]
        assert legend[0].startswith("CheckpointManager.save") and len(legend) == 3
        # Export on an axis of its own, apart from the resume times (20 ms vs 800 ms).
        export = next(ax for ax in fig.axes if ax.get_title().startswith("export"))
        resume = next(ax for ax in fig.axes if ax.get_title().startswith("resume"))
        assert export is not resume
        assert export.get_ylim()[1] < 0.1 < resume.get_ylim()[1]
        assert export.get_title().splitlines()[1:] == [
            "torch / pyckpt 1.50x", "from torch's input 2.00x", "(median of 5 runs)"]
        assert resume.get_title().splitlines()[1:] == ["DCP / pyckpt 2.00x", "(1 run)"]
        # Both of pyckpt's exports (from its zstd checkpoint, from torch's plain shards) and
        # torch's, each bar labelled with its time.
        assert [t.get_text() for t in export.get_xticklabels()] == [
            "pyckpt from\nits zstd ckpt", "pyckpt from\ntorch's input", "torch"]
        assert {"0.020", "0.015", "0.030"} <= {t.get_text() for t in export.texts}
        png = tmp_path / "demo.png"
        fig.savefig(png, dpi=50)
        width, height = png_size(png)
        assert width >= 600 and height >= 400
    finally:
        plt.close(fig)
