"""An export into a directory that already holds one: nothing of the earlier export is read.

Oracles: the directory listing after the export (an earlier export's shards that the new one does
not write are gone, as ``save_pretrained`` removes them; the user's other files stay), and
``safetensors`` / ``transformers``' ``from_pretrained``, which must load the new export.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _st_workers import load_outputs, same_bits
from safetensors.torch import load as st_load
from safetensors.torch import save_file

import pyckpt
from pyckpt._consolidate import INDEX_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(value: float) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((16, 32), value + i) for i in range(6)}


def _save(path, sd):
    pyckpt.save(sd, path)
    return path


def _export(src, dst, **kwargs):
    return pyckpt.consolidate(src, dst, fsync=False, threads=1, **kwargs)


def test_reexport_with_fewer_files_removes_the_earlier_exports_files(tmp_path):
    old = _save(tmp_path / "old", _state(1.0))
    new = _save(tmp_path / "new", _state(10.0))
    dst = tmp_path / "hf"
    _export(old, dst, max_file_bytes=4096)  # 6 files
    _export(old, dst, fqn_to_file={f"layers.{i}.w": f"part{i % 2}.safetensors" for i in range(6)})
    assert sorted(os.listdir(dst)) == [INDEX_NAME, "part0.safetensors", "part1.safetensors"]
    (dst / "config.json").write_text("{}")
    (dst / "extra.safetensors").write_bytes(b"not an export's")  # the user's, never listed
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    index = json.loads((dst / INDEX_NAME).read_text())
    index["weight_map"]["layers.0.w"] = "../outside.safetensors"  # a hostile index
    index["weight_map"]["layers.2.w"] = "part0.safetensors"
    (dst / INDEX_NAME).write_text(json.dumps(index))

    res = _export(new, dst, max_file_bytes=3 * 2048)  # 2 files
    assert sorted(os.listdir(dst)) == sorted([
        INDEX_NAME, "config.json", "extra.safetensors",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    assert outside.read_bytes() == b"x"
    # A reader that takes every *.safetensors file of the directory sees the new export only.
    seen = {}
    for name in sorted(os.listdir(dst)):
        if name.startswith("model-"):
            seen.update(st_load((dst / name).read_bytes()))
    assert seen.keys() == _state(10.0).keys()
    for k, v in _state(10.0).items():
        assert same_bits(seen[k], v), k
    assert load_outputs(res.index_path).keys() == seen.keys()


def test_a_model_safetensors_left_in_the_directory_is_refused(tmp_path):
    """``from_pretrained`` loads ``model.safetensors`` in preference to the index: an export
    next to one (here what ``save_pretrained`` of the untrained model wrote) would be ignored."""
    src = _save(tmp_path / "src", _state(10.0))
    dst = tmp_path / "hf"
    dst.mkdir()
    save_file(_state(1.0), str(dst / "model.safetensors"))
    with pytest.raises(FileExistsError, match="model.safetensors.*from_pretrained"):
        _export(src, dst)
    assert sorted(os.listdir(dst)) == ["model.safetensors"]

    # One that an earlier export wrote (listed by its index) is replaced like any shard.
    dst2 = tmp_path / "hf2"
    _export(src, dst2, fqn_to_file={n: "model.safetensors" for n in _state(0.0)})
    _export(src, dst2)
    assert sorted(os.listdir(dst2)) == ["model-00001-of-00001.safetensors", INDEX_NAME]


def test_transformers_loads_the_export_not_an_earlier_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    untrained = transformers.LlamaForCausalLM(config)
    trained = transformers.LlamaForCausalLM(config)
    dst = tmp_path / "hf"
    untrained.save_pretrained(dst)  # config.json and model.safetensors
    src = _save(tmp_path / "src", {"model": trained.state_dict()})
    with pytest.raises(FileExistsError, match="model.safetensors"):
        _export(src, dst)
    os.unlink(dst / "model.safetensors")
    _export(src, dst)
    loaded = transformers.LlamaForCausalLM.from_pretrained(dst)
    for k, v in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_failed_reexport_to_a_store_leaves_no_index_naming_a_mix(tmp_path, monkeypatch):
    """Re-exporting to an object store replaces its files one by one: the earlier index must be
    gone before the first, or a failure part way leaves it naming old and new files."""
    from pyckpt.backends import memory

    old = _save(tmp_path / "old", _state(1.0))
    new = _save(tmp_path / "new", _state(10.0))
    url = f"memory://stale-{tmp_path.name}"
    _export(old, url, max_file_bytes=3 * 2048)
    store = memory._stores[url]
    assert json.loads(store[INDEX_NAME])["weight_map"]
    put = memory.MemoryBackend.put_file

    def failing_second(self, path, *, last=False):
        if path.endswith("model-00002-of-00002.safetensors"):
            raise OSError(5, "injected upload failure", path)
        return put(self, path, last=last)

    monkeypatch.setattr(memory.MemoryBackend, "put_file", failing_second)
    with pytest.raises(OSError, match="injected"):
        _export(new, url, max_file_bytes=3 * 2048)
    assert INDEX_NAME not in store, "the earlier index names a mix of old and new files"
    monkeypatch.setattr(memory.MemoryBackend, "put_file", put)
    _export(new, url, max_file_bytes=3 * 2048)
    index = json.loads(store[INDEX_NAME])
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(st_load(store[name]))
    assert got.keys() == _state(10.0).keys()
    for k, v in _state(10.0).items():
        assert same_bits(got[k], v), k
    memory.drop(url)


def test_model_safetensors_as_one_of_several_files_is_refused(tmp_path):
    """``from_pretrained`` loads ``model.safetensors`` alone when it exists, ignoring the index:
    the tensors of every other file would be newly initialised, not loaded."""
    src = _save(tmp_path / "src", _state(1.0))
    mapping = {n: "model.safetensors" if n < "layers.3" else "rest.safetensors"
               for n in _state(0.0)}
    with pytest.raises(ValueError, match="model.safetensors.*from_pretrained"):
        _export(src, tmp_path / "hf", fqn_to_file=mapping)
    assert not (tmp_path / "hf").exists()
    # As the only file it is what from_pretrained reads: allowed.
    res = _export(src, tmp_path / "one", fqn_to_file=dict.fromkeys(mapping, "model.safetensors"))
    assert [os.path.basename(f) for f in res.files] == ["model.safetensors"]
