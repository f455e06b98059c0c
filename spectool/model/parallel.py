"""Tensor parallelism over torch.distributed: which tensors are split, and the collectives the model needs.

A target loaded with ``tp_size = N`` is split Megatron-style over N ranks of one process group
(NCCL on GPUs, gloo on CPUs):
- q/k/v and gate/up are column-parallel: each rank holds its heads (q heads and KV heads alike)
  and its share of the MLP's intermediate features, so its KV cache holds its KV heads only;
- o and down are row-parallel: each rank multiplies its share of the inputs and one all-reduce
  sums the partial outputs;
- the embedding and the lm_head are split by vocabulary: a rank looks up the ids it owns (zeros
  elsewhere, then an all-reduce), and computes the logits of its ids; ``gather_vocab`` joins them.
Every rank therefore holds the same hidden states, the same full logits and so takes the same
decisions; draft layers are replicated and run on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from spectool.model.config import ModelConfig

# A collective that waits longer than this means another rank has failed: the run ends with an
# error instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("SPECTOOL_TP_TIMEOUT_S", "120")))


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (in place)."""
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard of the last (vocabulary) dimension, in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place)."""
        import torch.distributed as dist

        dist.broadcast(x, src)
        return x


def check_divisible(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse a tp_size that does not split the heads, the MLP and the vocabulary evenly."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    for what, n in (("attention heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size), ("vocabulary size", cfg.vocab_size)):
        if n % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide the model's {what} ({n})")


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The config of one rank's shard: its heads, its MLP features and its vocabulary slice."""
    from dataclasses import replace

    check_divisible(cfg, tp_size)
    return replace(cfg, num_heads=cfg.num_heads // tp_size, num_kv_heads=cfg.num_kv_heads // tp_size,
                   intermediate_size=cfg.intermediate_size // tp_size, vocab_size=cfg.vocab_size // tp_size)


def split_dim(name: str) -> int | None:
    """The dimension along which tensor ``name`` (our name) is split: 0 column / vocabulary,
    1 row-parallel, None replicated (norms)."""
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight", "embed_tokens.weight",
                      "lm_head.weight")):
        return 0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return None


def init(tp_size: int, device: str | torch.device) -> TensorParallel:
    """Join (or start) the process group of ``tp_size`` ranks this process was launched in.

    The launcher (``torchrun --nproc-per-node N`` or ``spectool record --tp N``) sets RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Every check runs on every rank before any work.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or world == 1:
        raise ValueError(f"tp_size {tp_size} needs {tp_size} processes: launch with "
                         f"`torchrun --nproc-per-node {tp_size} ...` or `spectool record --tp {tp_size}`")
    if world != tp_size:
        raise ValueError(f"tp_size {tp_size} does not match the launched world size {world}")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.device_count() < tp_size:
            raise ValueError(f"tp_size {tp_size} needs {tp_size} GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank=dist.get_rank(), size=dist.get_world_size())


def local_device(device: str | torch.device, tp: TensorParallel | None) -> torch.device:
    """Each rank's own GPU (cuda:LOCAL_RANK) when the target is split over GPUs."""
    device = torch.device(device)
    if tp is None or device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", tp.rank)))
