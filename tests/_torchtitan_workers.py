"""Rank workers for tests/test_integration_torchtitan.py (and its benchmark): a tiny decoder
trained the way torchtitan's trainer drives its components, checkpointed by torchtitan's
checkpoint managers (its own ``CheckpointManager`` or pyckpt's subclass).

torchtitan's own model modules import triton (absent from CPU-only installs), and its Trainer
needs an accelerator, so the workers build the trainer's checkpointed components directly:
a model named like torchtitan's Llama (``tok_embeddings``, ``layers.N.attention.qkv_linear.wq``,
...) wrapped by FSDP2 ``fully_shard`` over a CPU mesh, torchtitan's real
``OptimizersContainer`` and ``LRSchedulersContainer``, a stateful data loader, a train state,
and a ``StateDictAdapter`` subclass mapping the names to Hugging Face Llama's. The manager is
built from its config exactly as the trainer builds it (``config.checkpoint.build(...)``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

DIM = int(os.environ.get("PYCKPT_TT_DIM", "32"))  # the benchmark makes it larger
VOCAB, HIDDEN, LAYERS, HEADS = 64, 2 * DIM, 2, 4
SEQ, BATCH = 8, 2


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_linear = nn.Module()
        self.qkv_linear.wq = nn.Linear(DIM, DIM, bias=False)
        self.qkv_linear.wk = nn.Linear(DIM, DIM, bias=False)
        self.qkv_linear.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            lin(x).view(b, s, HEADS, DIM // HEADS).transpose(1, 2)
            for lin in (self.qkv_linear.wq, self.qkv_linear.wk, self.qkv_linear.wv)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, DIM))


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = _Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = _FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyDecoder(nn.Module):
    """A Llama-shaped decoder with torchtitan's parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x))


# torchtitan name -> Hugging Face Llama name ("{}" is the layer).
_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        return _TO_HF[".".join(["layers", "{}", *parts[2:]])].format(parts[1])
    return _TO_HF[name]


def _adapter(hf_assets_path: str | None) -> Any:
    from torchtitan.protocols.state_dict_adapter import StateDictAdapter

    class TinyAdapter(StateDictAdapter):
        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return {hf_name(k): v for k, v in state_dict.items()}

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            back = {hf_name(k): k for k in TinyDecoder().state_dict()}
            return {back[k]: v for k, v in hf_state_dict.items()}

    return TinyAdapter(None, hf_assets_path)  # type: ignore[arg-type]


def write_hf_assets(path: str) -> None:
    """An ``hf_assets_path`` whose index spreads the weights over two files (so the export
    writes ``model-00001-of-00002.safetensors`` and ``-00002``), and the model's config."""
    import json

    from transformers import LlamaConfig

    names = [hf_name(k) for k in TinyDecoder().state_dict()]
    weight_map = {
        n: f"model-0000{1 if 'layers' not in n or '.0.' in n else 2}-of-00002.safetensors"
        for n in names
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, tie_word_embeddings=False,
        max_position_embeddings=SEQ,
    ).save_pretrained(path)


class DataLoader(Stateful):
    """Deterministic batches per rank; its position is checkpointed (like torchtitan's)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.position = 0

    def next_batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = state_dict["position"]


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class Job:
    """One training job on this rank: model, optimizers, schedulers, data, checkpointer."""

    def __init__(self, checkpoint_config: Any, dump_folder: str, hf_assets: str | None = None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        rank = dist.get_rank()
        torch.manual_seed(0)
        model = TinyDecoder()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(
                pattern=".*", optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
            implementation="for-loop",
        ).build(model_parts=[model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=100)
        self.dataloader = DataLoader(rank)
        self.train_state = TrainState()
        self.checkpointer = checkpoint_config.build(
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=_adapter(hf_assets),
            base_folder=dump_folder,
        )

    def train(self, steps: int, last: int | None = None) -> list[float]:
        """Trains to step ``steps`` (saving as the trainer does, ``last``: the final step);
        returns the losses (the mean over ranks) of the steps taken."""
        losses = []
        while self.train_state.step < steps:
            self.train_state.step += 1
            step = self.train_state.step
            batch = self.dataloader.next_batch()
            self.optimizers.zero_grad()
            logits = self.model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            loss.backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            losses.append(reported.item())
            self.checkpointer.save(step, last_step=(step == last))
            self.checkpointer.maybe_wait_for_staging()
        return losses

    def close(self) -> None:
        self.checkpointer.maybe_wait_for_saving()
        self.checkpointer.close()
