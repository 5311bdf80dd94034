"""Synthetic LLM-shaped bf16 state dicts sharded the way DCP's HuggingFaceStorageWriter shards them.

``PYCKPT_BENCH_SCALE`` (default 0.03) scales the state dict: 1.0 is about 1 GiB.
"""

from __future__ import annotations

import json
import os
import threading

import torch

SHARDING_KEY = "DCP_SHARDING_INFO"


def warm(src: str) -> None:
    """Reads every file of `src` (untimed), so each run starts from a warm page cache: this VM
    gives file pages back to the host within a minute or two, so inputs written or read a few
    runs earlier are partly cold again, which otherwise lands in whichever run comes next.

    In 128 KiB reads, as ``cat`` and pyckpt's own reads do: the page cache a first read leaves
    depends on its size (Linux 6.18, ext4 with large folios). 16 MiB reads left pages that read
    back at 26-27 GB/s, 128 KiB reads large folios at 49-51 GB/s, as a buffered write (torch's
    shards) leaves them; an export from the first was 15-25% slower (BENCHMARKS.md, "Reads in
    128 KiB pieces")."""
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path):
            with open(path, "rb", buffering=0) as fh:
                while fh.read(128 << 10):
                    pass


def drop(src: str) -> None:
    """Drops every file of `src` from the page cache (``POSIX_FADV_DONTNEED``; the files are
    clean): the state an O_DIRECT save (pyckpt's) leaves its files in."""
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def scale() -> float:
    return float(os.environ.get("PYCKPT_BENCH_SCALE", "0.03"))


def state_dict(target_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Llama-like layers (attention + gated MLP + norms) of bf16 until about target_bytes."""
    h, ffn = (2048, 5632) if target_bytes >= (512 << 20) else (512, 1408)
    per_layer = (4 * h * h + 3 * h * ffn + 2 * h) * 2
    layers = max(1, round(target_bytes / per_layer))
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = torch.randn(h, h, generator=g).to(torch.bfloat16)
        sd[p + "mlp.gate_proj.weight"] = torch.randn(ffn, h, generator=g).to(torch.bfloat16)
        sd[p + "mlp.up_proj.weight"] = torch.randn(ffn, h, generator=g).to(torch.bfloat16)
        sd[p + "mlp.down_proj.weight"] = torch.randn(h, ffn, generator=g).to(torch.bfloat16)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def write_shards(src: str, sd: dict[str, torch.Tensor], nshards: int, dim: int) -> None:
    """Shard file per rank, as HuggingFaceStorageWriter(save_distributed=True) writes them."""
    from safetensors.torch import save_file

    os.makedirs(src, exist_ok=True)
    for r in range(nshards):
        tensors, info = {}, {}
        for name, t in sd.items():
            d = dim if t.dim() > dim else 0
            pieces = torch.tensor_split(t, nshards, dim=d)
            offs = [0] * t.dim()
            offs[d] = sum(p.shape[d] for p in pieces[:r])
            tensors[name] = pieces[r].contiguous()
            info[name] = {"saved_offsets": offs}
        save_file(
            tensors,
            os.path.join(src, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"),
            metadata={SHARDING_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"},
        )


class MemSampler:
    """Samples RssAnon / RssFile of this process (peak, MiB) on a helper thread."""

    def __init__(self, period: float = 0.01) -> None:
        self.peak_anon = self.peak_file = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)

    @staticmethod
    def read() -> tuple[float, float]:
        vals = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":")
                    vals[k] = int(v.split()[0]) / 1024
        return vals.get("RssAnon", 0.0), vals.get("RssFile", 0.0) + vals.get("RssShmem", 0.0)

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            a, f = self.read()
            self.peak_anon, self.peak_file = max(self.peak_anon, a), max(self.peak_file, f)

    def __enter__(self) -> MemSampler:
        self.base_anon, _ = self.read()
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        a, f = self.read()
        self.peak_anon, self.peak_file = max(self.peak_anon, a), max(self.peak_file, f)


def _pyckpt_save_worker(
    rank: int, world: int, port: int, src: str, target_bytes: int, dim: int, compression
) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import pyckpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = {  # every rank builds the full tensors (seeded) and keeps its slice: no scatter
            k: distribute_tensor(v, mesh, [Shard(dim if v.dim() > dim else 0)], src_data_rank=None)
            for k, v in state_dict(target_bytes).items()
        }
        dcp.save(sd, storage_writer=pyckpt.Writer(src, compression=compression, fsync=False))
    finally:
        dist.destroy_process_group()


def write_pyckpt(src: str, target_bytes: int, nranks: int, dim: int, compression) -> None:
    """pyckpt checkpoint of ``state_dict(target_bytes)`` saved as DTensors by ``nranks`` gloo ranks.

    The same pieces as :func:`write_shards` (``Shard(dim)``, 1-D tensors along dim 0), so both
    inputs describe the same sharded state.
    """
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_pyckpt_save_worker, args=(nranks, port, src, target_bytes, dim, compression),
             nprocs=nranks, join=True)
