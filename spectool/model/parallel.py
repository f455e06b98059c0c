"""Tensor parallelism over torch.distributed: which tensors are split, and the collectives the model needs.

A target loaded with ``tp_size = N`` is split Megatron-style over N ranks of one process group
(NCCL on GPUs, gloo on CPUs):
- q/k/v and gate/up are column-parallel: each rank holds its heads (q heads and KV heads alike)
  and its share of the MLP's intermediate features, so its KV cache holds its KV heads only;
- o and down are row-parallel: each rank multiplies its share of the inputs and one all-reduce
  sums the partial outputs;
- the embedding and the lm_head are split by vocabulary: a rank looks up the ids it owns (zeros
  elsewhere, then an all-reduce), and computes the logits of its ids.

The whole logits are never joined on the greedy path: ``argmax_parts`` exchanges each rank's best
logit and its id ([B, N, 2] per rank, against [B, N, V / N]) and the verifier picks among them
(ties to the lowest id, as a single rank's argmax); ``topk`` exchanges each rank's k best and its
log-sum-exp, for the recorded target top-k and the draft layers' softmax top-k. Sampling needs
the whole distribution: it joins the logits (``gather_vocab``, one all-gather per step).

Every rank takes the same decisions from the same bits: an all-reduce or an all-gather gives
every rank the same result, so the hidden states, the exchanged maxima and the joined logits are
equal everywhere, the replicated draft layers compute the same trees, and the sampling coins are
counter-based (keyed by the seed and the request), not drawn from a per-process generator.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass, field
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
    # Host tensors (the N-gram trees rank 0 drafts) travel over gloo: a group of its own beside NCCL,
    # None when the default group is gloo already.
    host_group: object = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (in place)."""
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return parts

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's shard of the last (vocabulary) dimension, in rank order."""
        return torch.cat(self.all_gather(x), dim=-1)

    def argmax_parts(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's largest logit and its token id, from this rank's vocabulary slice
        ``local`` [..., V / size]: ``(values float32 [..., size], ids int64 [..., size])``.

        The argmax over the whole vocabulary is the id of the largest value, the lowest id among
        equal ones (``spectool.verify.verify_greedy_parts``). NaN counts as the largest value, as
        in ``torch.argmax``. One all-gather of two numbers per row.
        """
        x = local.float()
        x = torch.where(x.isnan(), float("inf"), x)
        i = x.argmax(-1, keepdim=True)  # the first maximum: the lowest id of this slice
        # float64 holds a float32 value and a token id exactly: one collective for both.
        mine = torch.cat([x.gather(-1, i).double(), (i + self.rank * local.shape[-1]).double()], dim=-1)
        every = torch.stack(self.all_gather(mine), dim=-2)  # [..., size, 2]
        return every[..., 0].float(), every[..., 1].long()

    def argmax(self, local: torch.Tensor) -> torch.Tensor:
        """The argmax over the whole vocabulary [...] int64, from this rank's slice ``local``."""
        return argmax_of_parts(*self.argmax_parts(local))

    def topk(self, local: torch.Tensor, k: int, softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``spectool.kernels.topk.row_topk`` over the whole vocabulary from this rank's slice
        ``local`` [..., V / size], with its semantics (NaN as -inf, ties to the lower id, under
        softmax +inf as the largest float32): ``(values float32 [..., k], ids int64 [..., k])``.

        Each rank's k best (value, id) and, for softmax, its log-sum-exp are exchanged in one
        all-gather of 2k + 1 numbers per row; the probabilities are exp(value - log-sum-exp).
        """
        from spectool.kernels.topk import FLOAT32_MAX, row_topk

        n = local.shape[-1]
        kk = min(k, n)
        values, ids = row_topk(local, kk)
        # float64 holds float32 values and token ids exactly: one collective for all.
        parts = [(values.clamp(max=FLOAT32_MAX) if softmax else values).double(), (ids + self.rank * n).double()]
        if softmax:
            clean = local.float().nan_to_num(nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))
            parts.append(torch.logsumexp(clean, dim=-1, keepdim=True).double())
        every = self.all_gather(torch.cat(parts, dim=-1))
        # Rank order = id order, and each rank's candidates come in row_topk's order: among equal
        # values the lower position is the lower id, so row_topk's tie rule carries over.
        cand = torch.cat([e[..., :kk] for e in every], dim=-1).float()
        cand_ids = torch.cat([e[..., kk:2 * kk] for e in every], dim=-1).long()
        best, pos = row_topk(cand, k)
        top_ids = cand_ids.gather(-1, pos)
        if not softmax:
            return best, top_ids
        lse = torch.logsumexp(torch.cat([e[..., -1:] for e in every], dim=-1), dim=-1, keepdim=True)
        # A row with no entry above -inf has probability 0 everywhere, as in row_topk.
        return torch.exp(best.double() - lse).float().nan_to_num(nan=0.0), top_ids

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place)."""
        import torch.distributed as dist

        dist.broadcast(x, src)
        return x

    def broadcast_host(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s host tensor ``x`` on every rank (in place), over gloo."""
        import torch.distributed as dist

        dist.broadcast(x, src, group=self.host_group)
        return x


def argmax_of_parts(vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The id of the largest of ``vals`` [..., P] (``ids`` [..., P] their token ids), the lowest
    id among equal values: one argmax over the joined parts."""
    best = vals.max(-1, keepdim=True).values
    return torch.where(vals == best, ids, torch.iinfo(torch.int64).max).min(-1).values


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
        # A group left to the interpreter's exit tears its threads down in no set order: a gloo rank
        # then dies now and then in std::terminate ("terminate called without an active exception").
        atexit.register(_leave_process_group)
    host_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank=dist.get_rank(), size=dist.get_world_size(), host_group=host_group)


def _leave_process_group() -> None:
    """Destroy the process group ``init`` started, before the interpreter's own teardown; not when
    this rank is ending on an uncaught exception: destroying the group would end the other ranks'
    collectives with "connection closed" while this rank is still exiting, and the launcher would
    name one of them, not this rank, as the one that failed."""
    import torch.distributed as dist

    if getattr(sys, "last_value", None) is None and dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: str | torch.device, tp: TensorParallel | None) -> torch.device:
    """Each rank's own GPU (cuda:LOCAL_RANK) when the target is split over GPUs."""
    device = torch.device(device)
    if tp is None or device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", tp.rank)))
