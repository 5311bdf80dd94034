"""Aimed export: choosing, renaming, casting and de-duplicating what ``pyckpt.consolidate`` writes.

Oracles: ``safetensors.torch.load_file`` reads every output (an independent reader);
``Tensor.to(dtype)`` is the reference for casts; ``transformers``' ``from_pretrained`` loads the
README quickstart's ``{"model": ..., "optim": ...}`` checkpoint exported with the defaults.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _export_workers import dtensor_state, save_and_export_cast
from _st_workers import grid_blocks, load_outputs, same_bits, sample_tensor, write_dcp_shards
from dist_utils import run_distributed

import pyckpt
from pyckpt import _C, ExportNameCollisionError, UnsupportedDtypeError
from pyckpt._consolidate import INDEX_NAME

_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _save(path, sd, compression="zstd", chunk_bytes=4096):
    dcp.save(sd, storage_writer=pyckpt.Writer(path, compression=compression,
                                              chunk_bytes=chunk_bytes, fsync=False))


def _export(src, dst, **kwargs):
    return pyckpt.consolidate(src, dst, fsync=False, threads=2, **kwargs)


def _index(dst):
    with open(os.path.join(dst, INDEX_NAME)) as fh:
        return json.load(fh)


def _listing(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _same_cast(got: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` is ``src.to(dtype)`` bit for bit, except that NaN bits are only NaN with its sign
    (torch's own NaN bits differ between its kernels and CPUs; see csrc/core/float_cast.hpp)."""
    ref = src.to(dtype)
    assert got.dtype == dtype and got.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    ib = _INT[ref.element_size()]
    g, r = got.contiguous().view(ib), ref.contiguous().view(ib)
    assert torch.equal(g[~nan], r[~nan]), (g[~nan] != r[~nan]).nonzero()[:5]
    assert torch.equal(_negative(got)[nan], _negative(src)[nan])


def _negative(t: torch.Tensor) -> torch.Tensor:
    """The sign bit of every element (NaNs included), read from the bits."""
    return t.contiguous().view(_INT[t.element_size()]) < 0


# ----------------------------------------------------------------------------- acceptance


def _transformers():
    # Only the acceptance tests need transformers; the rest of the module runs without it.
    return pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install 'pyckpt[test]')"
    )


def _trained_llama(tie: bool):
    """The README quickstart's objects: a (tiny) model and its AdamW optimizer, trained 3 steps."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie, attention_dropout=0.0, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(96, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    model.eval()
    return model, optim, ids


def _load_hf(dst, model, **kwargs):
    model.config.save_pretrained(dst)
    hf, info = _transformers().LlamaForCausalLM.from_pretrained(
        dst, output_loading_info=True, attn_implementation="eager", **kwargs
    )
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return hf.eval()


def test_quickstart_checkpoint_exports_the_model_by_default(tmp_path):
    model, optim, ids = _trained_llama(tie=False)
    # README quickstart, verbatim layout.
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.save(state, storage_writer=pyckpt.Writer(tmp_path / "ckpt", compression="zstd"))

    res = pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "hf", fsync=False)
    assert "select=None" in res.selection and "'optim'" in res.selection
    out = load_outputs(res.index_path)
    expect = model.state_dict()
    assert sorted(out) == sorted(expect)  # model only, no "model." prefix, no optimizer state
    for k, v in expect.items():
        assert same_bits(out[k], v), k
    assert res.total_bytes == sum(v.numel() * v.element_size() for v in expect.values())

    hf = _load_hf(tmp_path / "hf", model)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, model(input_ids=ids).logits)

    # Everything, as the selection message says: optimizer state included, names untouched.
    res_all = pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "all", fsync=False, select=None)
    names = set(load_outputs(res_all.index_path))
    assert {f"model.{k}" for k in expect} < names
    assert any(n.startswith("optim.state.") for n in names)


def test_quickstart_tied_embeddings_written_once(tmp_path):
    model, optim, ids = _trained_llama(tie=True)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.save(state, storage_writer=pyckpt.Writer(tmp_path / "ckpt", compression="zstd"))
    emb = model.state_dict()["model.embed_tokens.weight"]

    plain = _export(tmp_path / "ckpt", tmp_path / "plain", dedup_tied=False)
    assert "lm_head.weight" in _index(tmp_path / "plain")["weight_map"] and plain.tied == {}

    res = _export(tmp_path / "ckpt", tmp_path / "hf")  # the default, as dedup_tied=True
    assert res.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    index = _index(tmp_path / "hf")
    assert "lm_head.weight" not in index["weight_map"]
    assert index["metadata"]["tied_weights"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert plain.total_bytes - res.total_bytes == emb.numel() * emb.element_size()
    out = load_outputs(res.index_path)
    assert "lm_head.weight" not in out and same_bits(out["model.embed_tokens.weight"], emb)
    # No scratch file left behind by the content comparison.
    assert _listing(tmp_path / "hf") == sorted([INDEX_NAME, "model-00001-of-00001.safetensors"])

    hf = _load_hf(tmp_path / "hf", model)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, model(input_ids=ids).logits)


def test_quickstart_export_cast_to_bf16(tmp_path):
    model, optim, ids = _trained_llama(tie=False)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    dcp.save(state, storage_writer=pyckpt.Writer(tmp_path / "ckpt", compression="zstd"))
    res = _export(tmp_path / "ckpt", tmp_path / "hf", dtype=torch.bfloat16)
    out = load_outputs(res.index_path)
    for k, v in model.state_dict().items():
        _same_cast(out[k], v, torch.bfloat16)
    hf = _load_hf(tmp_path / "hf", model, dtype=torch.bfloat16)
    # Every weight transformers loaded is the trained model's cast by torch, bit for bit. (Logits
    # are not compared: model.to(bf16) also casts non-persistent buffers such as the rotary
    # inv_freq, which from_pretrained recomputes in fp32.)
    ref = copy.deepcopy(model).to(torch.bfloat16).state_dict()
    for k, v in hf.state_dict().items():
        assert same_bits(v, ref[k]), k
    with torch.no_grad():
        assert torch.isfinite(hf(input_ids=ids).logits).all()


# ----------------------------------------------------------------------------- selection


def _layout_state():
    g = torch.Generator().manual_seed(2)
    return {
        "model": {
            "enc.w": torch.randn(8, 6, generator=g),
            "enc.b": torch.randn(6, generator=g),
            "head.w": torch.randn(4, 6, generator=g).to(torch.bfloat16),
            "ids": torch.arange(5, dtype=torch.int64),
        },
        "optim": {
            "state": {"0": {"exp_avg": torch.randn(8, 6, generator=g),
                            "freqs": torch.ones(3, dtype=torch.complex128)}},
            "lr": 0.1,
        },
    }


def _model_tensors():
    return _layout_state()["model"]


@pytest.fixture
def layout_ckpt(tmp_path):
    path = tmp_path / "ckpt"
    _save(path, _layout_state())
    return path


def test_default_on_model_optim_layout_skips_unsupported_optimizer_state(tmp_path, layout_ckpt):
    with pytest.warns(UserWarning, match=r"skipping 1 tensor.*'optim\.state\.0\.freqs' \(complex128"):
        res = _export(layout_ckpt, tmp_path / "dst")
    assert res.skipped == ["optim.state.0.freqs"]
    out = load_outputs(res.index_path)
    expect = _model_tensors()
    assert sorted(out) == sorted(expect)
    for k, v in expect.items():
        assert same_bits(out[k], v), k


def test_default_recognises_optimizer_key_and_state_without_tensors(tmp_path):
    # {"model", "optimizer"} where the optimizer holds no tensor at all (plain SGD): its
    # non-tensor items still mark the layout.
    sd = {"model": _model_tensors(), "optimizer": {"param_groups": [{"lr": 0.1, "params": [0]}]}}
    _save(tmp_path / "ckpt", sd)
    res = _export(tmp_path / "ckpt", tmp_path / "dst")
    assert sorted(load_outputs(res.index_path)) == sorted(_model_tensors())
    assert "'optimizer'" in res.selection


def test_default_on_other_layouts_exports_everything_unchanged(tmp_path):
    sd = {"model.a": torch.ones(3), "encoder.w": torch.zeros(2, 2), "step": torch.tensor(7)}
    _save(tmp_path / "ckpt", sd)
    res = _export(tmp_path / "ckpt", tmp_path / "dst")
    out = load_outputs(res.index_path)
    assert sorted(out) == sorted(sd) and all(same_bits(out[k], v) for k, v in sd.items())


@pytest.mark.parametrize(
    ("select", "expect"),
    [
        ("model.enc.", ["model.enc.b", "model.enc.w"]),
        (["model.enc.w", "model.ids"], ["model.enc.w", "model.ids"]),
        (re.compile(r"\.(w|b)$"), ["model.enc.b", "model.enc.w", "model.head.w"]),
        (lambda n: n.endswith("exp_avg"), ["optim.state.0.exp_avg"]),
        (["model.ids", re.compile("^optim.*avg$")], ["model.ids", "optim.state.0.exp_avg"]),
    ],
    ids=["prefix", "prefixes", "regex", "callable", "mixed"],
)
def test_select_forms(tmp_path, layout_ckpt, select, expect):
    with pytest.warns(UserWarning, match="freqs"):  # unselected complex128: skipped, said so
        res = _export(layout_ckpt, tmp_path / "dst", select=select)
    out = load_outputs(res.index_path)
    assert sorted(out) == expect
    state = _layout_state()
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat["optim.state.0.exp_avg"] = state["optim"]["state"]["0"]["exp_avg"]
    for k in expect:
        assert same_bits(out[k], flat[k]), k


def test_strip_prefix_and_rename(tmp_path, layout_ckpt):
    with pytest.warns(UserWarning, match="freqs"):
        res = _export(layout_ckpt, tmp_path / "a", select="model.", strip_prefix=["model.", "x."],
                      rename={"enc.": "encoder.", "head.w": "lm_head.weight", "encoder.": "no"})
    out = load_outputs(res.index_path)
    m = _model_tensors()
    assert sorted(out) == ["encoder.b", "encoder.w", "ids", "lm_head.weight"]
    assert same_bits(out["encoder.w"], m["enc.w"]) and same_bits(out["lm_head.weight"], m["head.w"])
    with pytest.warns(UserWarning, match="freqs"):
        res = _export(layout_ckpt, tmp_path / "b", select="model.", rename=str.upper)
    assert sorted(load_outputs(res.index_path)) == ["MODEL.ENC.B", "MODEL.ENC.W", "MODEL.HEAD.W",
                                                    "MODEL.IDS"]


def test_rename_collision_names_both_sources(tmp_path, layout_ckpt):
    with pytest.raises(ExportNameCollisionError) as info:
        _export(layout_ckpt, tmp_path / "dst", rename={"enc.": "x.", "head.": "x."})
    assert info.value.name == "x.w"
    assert info.value.sources == ("model.enc.w", "model.head.w")
    assert "'model.enc.w'" in str(info.value) and "'model.head.w'" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, pyckpt.PyckptError)
    assert _listing(tmp_path / "dst") == []


def test_selected_unsupported_dtype_raises_naming_it(tmp_path, layout_ckpt):
    for select in (None, ["model.", "optim."]):
        with pytest.raises(UnsupportedDtypeError, match=r"'optim\.state\.0\.freqs' \(complex128\)"):
            _export(layout_ckpt, tmp_path / "dst", select=select)
        assert _listing(tmp_path / "dst") == []


def test_bad_arguments(tmp_path, layout_ckpt):
    with pytest.raises(ValueError, match="matches none"):
        _export(layout_ckpt, tmp_path / "d", select="nothing.")
    for kwargs in ({"dtype": "int8"}, {"dtype": torch.int8}, {"select": 5}, {"select": []},
                   {"rename": {"": "x"}}, {"strip_prefix": [""]}, {"dedup_tied": "yes"},
                   {"dedup_tied": {"a": "a"}}):
        with pytest.raises(ValueError):
            _export(layout_ckpt, tmp_path / "d", **kwargs)
    assert _listing(tmp_path / "d") == []


@pytest.mark.filterwarnings("ignore:consolidate. skipping:UserWarning")  # optim's complex128
@pytest.mark.parametrize("rename", [{"ids": ""}, lambda n: "" if n == "ids" else n])
def test_rename_to_an_empty_name_is_refused_either_way(tmp_path, layout_ckpt, rename):
    # A tensor named "" (which no model has) was written when a mapping gave it.
    with pytest.raises(ValueError, match="'ids'.*not a non-empty name"):
        _export(layout_ckpt, tmp_path / "d", rename=rename)
    assert _listing(tmp_path / "d") == []


# ----------------------------------------------------------------------------- dtype cast


def _convert(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(src.numel(), dtype=dtype)
    _C.convert_floats(src.contiguous().view(torch.uint8).numpy(), _ST[src.dtype], _ST[dtype],
                      out.view(torch.uint8).numpy())
    return out.reshape(src.shape)


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16])
def test_convert_every_16_bit_value(src_dtype):
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(src_dtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if dtype != src_dtype:
            _same_cast(_convert(every, dtype), every, dtype)


def test_convert_f32_edges_ties_subnormals():
    specials = [
        0, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00001, 0x7FBFFFFF,  # NaNs, quiet and signalling
        0x00000001, 0x807FFFFF, 0x00800000,  # f32 subnormals, smallest normal
        0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # largest finite: bf16 rounds to inf at the tie
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF,  # bf16 ties to even, either side
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001,  # 65504, just under / at the fp16 inf tie
        0x33000000, 0x33000001, 0x33800000, 0x33C00000, 0x34200000,  # 2^-25 tie, 2^-24, 1.5 ulp
        0x387FC000, 0x387FE000, 0x387FF000, 0x38800000,  # top of the fp16 subnormals
        0x3F801000, 0x3F803000, 0x3F801001, 0x3F802FFF,  # fp16 ties to even around 1
    ]
    both = specials + [v ^ 0x80000000 for v in specials]
    special = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in both],
                           dtype=torch.int32).view(torch.float32)
    rand = torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(5)).to(torch.int32)
    values = torch.cat([special, rand.view(torch.float32)])
    for dtype in (torch.bfloat16, torch.float16):
        _same_cast(_convert(values, dtype), values, dtype)


def test_convert_f64_rounds_through_f32_like_torch():
    # 1 + 2^-11 + 2^-40: directly to fp16 it would round up; through float32 (as torch does) it
    # becomes the tie 1 + 2^-11 and rounds to even, 1.0.
    tricky = torch.tensor([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, 1e300, -1e-300, 2.0**-1074],
                          dtype=torch.float64)
    rand = torch.randint(-(2**63), 2**63 - 1, (1 << 18,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(6)).view(torch.float64)
    values = torch.cat([tricky, rand, torch.randn(1 << 16, dtype=torch.float64) * 1e3])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        _same_cast(_convert(values, dtype), values, dtype)
    assert _convert(tricky[:1], torch.float16).item() == 1.0


def _cast_state():
    g = torch.Generator().manual_seed(8)
    f32 = torch.randn(33, 70, generator=g)
    f32.view(-1)[:6] = torch.tensor([float("nan"), -float("inf"), 1e-41, 65520.0, -0.0, 3e38])
    return {
        "f32": f32,
        "f64": torch.randn(5, 7, generator=g, dtype=torch.float64),
        "f16": torch.randn(40, 3, generator=g).to(torch.float16),
        "bf16": torch.randn(4, 50, generator=g).to(torch.bfloat16),
        "i32": torch.randint(-100, 100, (6, 5), generator=g, dtype=torch.int32),
        "fp8": sample_tensor((3, 9), torch.float8_e4m3fn, 9),
        "flag": torch.tensor(True),
    }


@pytest.mark.parametrize("kind", ["pyckpt-zstd", "pyckpt-raw", "st-dim0", "st-dim1", "st-dim1-mmap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_on_export_bit_exact(tmp_path, kind, dtype):
    sd = _cast_state()
    src = tmp_path / "src"
    if kind.startswith("pyckpt"):
        _save(src, sd, None if kind == "pyckpt-raw" else "zstd", chunk_bytes=4096)
    else:  # DCP sharded safetensors, 3 uneven shards along dim 0 or dim 1 (scattered rows)
        dim = int(kind[len("st-dim")])
        blocks = {k: grid_blocks(tuple(v.shape), [3 if d == dim else 1 for d in range(v.dim())],
                                 uneven=True) for k, v in sd.items()}
        write_dcp_shards(str(src), sd, blocks, 3)
    res = _export(src, tmp_path / "dst", dtype=dtype, max_file_bytes=2000,
                  input_mode="mmap" if kind.endswith("mmap") else "pread")
    assert len(res.files) > 1
    out = load_outputs(res.index_path)
    assert sorted(out) == sorted(sd)
    for k, v in sd.items():
        if v.dtype in _ST:
            _same_cast(out[k], v, dtype)
        else:  # integers, bool and float8 are never cast
            assert same_bits(out[k], v), k
    size = sum(v.numel() * (dtype.itemsize if v.dtype in _ST else v.element_size())
               for v in sd.values())
    assert res.total_bytes == size == _index(tmp_path / "dst")["metadata"]["total_size"]


@pytest.mark.distributed
def test_cast_dtensor_shards_on_two_ranks(tmp_path):
    # Column shards decoded chunk by chunk into scattered rows, each rank writing a byte range.
    results = run_distributed(save_and_export_cast, 2, str(tmp_path))
    full, _ = dtensor_state()
    assert sum(r[0] for r in results) == results[0][1] and all(r[0] > 0 for r in results)
    out = load_outputs(str(tmp_path / "dst" / INDEX_NAME))
    assert sorted(out) == ["cols", "half", "ids", "rows"]
    for k in ("cols", "half", "rows"):
        _same_cast(out[k], full[f"model.{k}"], torch.bfloat16)
    assert same_bits(out["ids"], full["model.ids"])


def test_stitch_refuses_inconsistent_cast(tmp_path):
    src = tmp_path / "in.bin"
    torch.arange(8, dtype=torch.float32).numpy().tofile(src)
    out = tmp_path / "out.bin"
    out.write_bytes(b"\0" * 16)
    item = ("t", [8], [0], [8], 4, str(src), 0, str(out), 0, 0, 8, 0, 2**64 - 1)
    _C.stitch([(*item, ("F32", "BF16"))], 1, 1 << 20, "pread", False)
    assert torch.equal(torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.bfloat16),
                       torch.arange(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot cast F16 to BF16 with item_bytes 4"):
        _C.stitch([(*item, ("F16", "BF16"))], 1, 1 << 20, "pread", False)
    with pytest.raises(ValueError, match="cannot cast dtype 'I32'"):
        _C.stitch([(*item, ("I32", "BF16"))], 1, 1 << 20, "pread", False)
    with pytest.raises(ValueError, match="too short"):  # fp32 output needs 32 bytes, not 16
        _C.stitch([item], 1, 1 << 20, "pread", False)


# ----------------------------------------------------------------------------- tied weights


def test_dedup_compares_bytes_across_shardings_and_ignores_equal_norms(tmp_path):
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(12, 8, generator=g)
    sd = {
        "wte.embed.weight": emb, "head.weight": emb.clone(), "other.weight": emb + 1,
        "n1.weight": torch.ones(8), "n2.weight": torch.ones(8),  # equal, but not embedding ties
        "z1.weight": torch.zeros(3, 8), "z2.weight": torch.zeros(3, 8),
    }
    blocks = {k: grid_blocks(tuple(v.shape), [3] + [1] * (v.dim() - 1)) for k, v in sd.items()}
    blocks["head.weight"] = grid_blocks((12, 8), [1, 2])  # the copy is cut along the other dim
    write_dcp_shards(str(tmp_path / "src"), sd, blocks, 3)
    res = _export(tmp_path / "src", tmp_path / "dst", dedup_tied=True)
    assert res.tied == {"head.weight": "wte.embed.weight"}
    out = load_outputs(res.index_path)
    assert sorted(out) == sorted(set(sd) - {"head.weight"})
    assert all(same_bits(out[k], sd[k]) for k in out)
    assert _listing(tmp_path / "dst") == sorted([INDEX_NAME, "model-00001-of-00001.safetensors"])


def test_dedup_explicit_pairs_are_verified(tmp_path):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 4, generator=g)
    sd = {"wte": w, "out": w.clone(), "diff": w + 1}
    _save(tmp_path / "ckpt", sd)
    res = _export(tmp_path / "ckpt", tmp_path / "dst", dedup_tied={"out": "wte"})
    assert res.tied == {"out": "wte"}
    assert sorted(load_outputs(res.index_path)) == ["diff", "wte"]
    with pytest.raises(ValueError, match="'diff' and 'wte' differ"):
        _export(tmp_path / "ckpt", tmp_path / "bad", dedup_tied={"diff": "wte"})
    with pytest.raises(ValueError, match="not exported"):
        _export(tmp_path / "ckpt", tmp_path / "bad", dedup_tied={"nope": "wte"})
    assert _listing(tmp_path / "bad") == []


def test_fqn_to_file_placing_a_tied_copy_says_it_is_tied(tmp_path):
    # Before: "fqn_to_file names tensors not in the checkpoint: ['lm_head.weight']".
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    _save(tmp_path / "ckpt", {"model.embed_tokens.weight": w, "lm_head.weight": w.clone()})
    layout = {"model.embed_tokens.weight": 1, "lm_head.weight": 2}
    with pytest.raises(ValueError, match=r"'lm_head.weight' \(= 'model.embed_tokens.weight'\), "
                                         "tied weights.*dedup_tied=False"):
        _export(tmp_path / "ckpt", tmp_path / "bad", fqn_to_file=layout)
    assert _listing(tmp_path / "bad") == []
    res = _export(tmp_path / "ckpt", tmp_path / "both", fqn_to_file=layout, dedup_tied=False)
    assert sorted(load_outputs(res.index_path)) == sorted(layout)


# ----------------------------------------------------------------------------- command line


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pyckpt", "consolidate", *map(str, args), "--no-fsync"],
        env={**os.environ, "PYCKPT_WORKER_BYTES": "0"},  # --workers 2 however small the input
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_cli_default_and_options(tmp_path, layout_ckpt):
    # Default over 2 worker processes: one output file, so the ranks split it (and its tensors)
    # by byte range; the cast happens in both.
    proc = _cli(layout_ckpt, tmp_path / "a", "--workers", "2", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "exporting the model" in proc.stderr and "--all" in proc.stderr
    assert "freqs" in proc.stderr  # the skip warning, from the planning worker
    out = load_outputs(str(tmp_path / "a" / INDEX_NAME))
    m = _model_tensors()
    assert sorted(out) == sorted(m)
    for k, v in m.items():
        if v.is_floating_point():
            _same_cast(out[k], v, torch.bfloat16)
        else:
            assert same_bits(out[k], v)

    proc = _cli(layout_ckpt, tmp_path / "b", "--select", "model.enc.", "--select-regex", "ids$",
                "--strip-prefix", "model.", "--rename", "enc.=encoder.", "--quiet")
    assert proc.returncode == 0, proc.stderr
    out = load_outputs(str(tmp_path / "b" / INDEX_NAME))
    assert sorted(out) == ["encoder.b", "encoder.w", "ids"]
    assert same_bits(out["encoder.w"], m["enc.w"])


def test_cli_all_and_bad_options(tmp_path):
    sd = {"model": {"embed.w": torch.ones(4, 2)}, "optim": {"m": torch.zeros(4, 2)},
          "lm_head": {"w": torch.ones(4, 2)}}
    _save(tmp_path / "ckpt", sd)
    proc = _cli(tmp_path / "ckpt", tmp_path / "all", "--all", "--no-dedup-tied", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert sorted(load_outputs(str(tmp_path / "all" / INDEX_NAME))) == [
        "lm_head.w", "model.embed.w", "optim.m"]
    proc = _cli(tmp_path / "ckpt", tmp_path / "t", "--all", "--quiet")  # --dedup-tied: default
    assert proc.returncode == 0, proc.stderr
    index = _index(tmp_path / "t")
    assert index["metadata"]["tied_weights"] == {"lm_head.w": "model.embed.w"}
    for bad, msg in (
        (["--rename", "nope"], "OLD=NEW"),
        (["--all", "--select", "x"], "--all"),
        (["--select-regex", "("], "--select-regex"),
        (["--dedup-tied", "--no-dedup-tied"], "contradict"),
        (["--all", "--rename", "model.embed.=x.", "--rename", "lm_head.=x."],
         "would both be exported as 'x.w'"),
    ):
        proc = _cli(tmp_path / "ckpt", tmp_path / "bad", *bad, "--quiet")
        assert proc.returncode == 1, (bad, proc.stderr)
        assert "pyckpt consolidate: error:" in proc.stderr and msg in proc.stderr, proc.stderr
    assert _listing(tmp_path / "bad") == []


def test_node_local_export_takes_the_same_options(tmp_path):
    # shared_filesystem=False plans on rank 0 like the shared path: the default model-only
    # choice and the cast apply; tied-weight dedup (which compares bytes on rank 0) is refused.
    sd = {"model": {"w": torch.randn(4, 3), "n": torch.arange(3)}, "optim": {"m": torch.zeros(4, 3)}}
    pyckpt.save(sd, tmp_path / "ckpt", shared_filesystem=False)
    res = pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "dst", shared_filesystem=False,
                             dtype="bf16", fsync=False)
    assert "exporting the model" in res.selection
    out = load_outputs(res.index_path)
    assert sorted(out) == ["n", "w"] and same_bits(out["n"], sd["model"]["n"])
    _same_cast(out["w"], sd["model"]["w"], torch.bfloat16)
    with pytest.raises(ValueError, match="dedup_tied is not supported with shared_filesystem"):
        pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "d2", shared_filesystem=False,
                           dedup_tied=True)


@pytest.mark.parametrize(
    ("embedding", "head"),
    [("model.embed_tokens.weight", "lm_head.weight"),  # Llama, Mistral, Qwen
     ("transformer.wte.weight", "lm_head.weight"),  # GPT-2
     ("shared.weight", "lm_head.weight"),  # T5
     ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")],  # BERT
)
def test_tie_candidates_pair_heads_with_input_embeddings(embedding, head):
    from pyckpt import _export

    names = {embedding: "F32", head: "F32", "norm.weight": "F32", "o.weight": "F32",
             "x.shared_proj.weight": "F32"}
    shapes = {embedding: (50, 8), head: (50, 8), "norm.weight": (8,), "o.weight": (8, 8),
              "x.shared_proj.weight": (50, 8)}
    spec = _export.make_spec(select=None, dedup_tied=True)
    choice = _export.choose(spec, names)
    pairs = _export.tie_candidates(choice, spec, names, shapes)
    assert pairs == sorted([(head, embedding), ("x.shared_proj.weight", embedding)])
    # Only pairs whose bytes are equal become ties.
    digests = {embedding: b"e", head: b"e", "x.shared_proj.weight": b"other"}
    assert _export.find_ties(choice, pairs, digests.__getitem__, explicit=False) == {head: embedding}


def test_gpt2_tied_head_is_written_once_by_default(tmp_path):
    # GPT-2 ties lm_head.weight to transformer.wte.weight; the export used to write both (the
    # dedup was opt-in), where transformers' save_pretrained writes the embedding alone. The
    # export must still load in transformers with identical logits.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    pyckpt.save(sd, tmp_path / "ckpt")
    res = pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "hf")
    assert res.tied == {"lm_head.weight": "transformer.wte.weight"}
    out = load_outputs(str(tmp_path / "hf" / INDEX_NAME))
    assert "lm_head.weight" not in out and same_bits(out["transformer.wte.weight"],
                                                      sd["transformer.wte.weight"])
    assert res.total_bytes == sum(v.nbytes for k, v in sd.items() if k != "lm_head.weight")
    cfg.save_pretrained(tmp_path / "hf")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    # Opting out writes both.
    res = pyckpt.consolidate(tmp_path / "ckpt", tmp_path / "both", dedup_tied=False)
    assert res.tied == {} and "lm_head.weight" in load_outputs(str(tmp_path / "both" / INDEX_NAME))
