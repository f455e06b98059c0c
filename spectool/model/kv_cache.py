"""The static KV cache: one preallocated tensor pair whose addresses never move (CUDA-graph safe)."""

from __future__ import annotations

import torch

from spectool.model.config import ModelConfig


class KVCache:
    """k, v: [num_layers, max_batch, kv_heads, max_seq_len, head_dim], allocated once.

    A request keeps its slot (index into max_batch) for its whole life; slots are
    reused by later requests without reallocation.
    """

    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        for name, value in (("num_layers", num_layers), ("max_batch", max_batch),
                            ("num_kv_heads", num_kv_heads), ("max_seq_len", max_seq_len),
                            ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"KVCache {name} must be positive, got {value}")
        shape = (num_layers, max_batch, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_batch: int, max_seq_len: int, dtype: torch.dtype,
                  device: str | torch.device, num_layers: int | None = None) -> KVCache:
        """A cache shaped for ``cfg`` (``num_layers`` overrides, e.g. 1 for a draft layer)."""
        if cfg.sliding_window is not None and max_seq_len > cfg.sliding_window:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's sliding_window="
                             f"{cfg.sliding_window}; sliding-window attention is not implemented")
        return cls(num_layers or cfg.num_layers, max_batch, cfg.num_kv_heads, max_seq_len,
                   cfg.head_dim, dtype, device)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer i: k, v [max_batch, kv_heads, max_seq_len, head_dim]."""
        return self.k[i], self.v[i]
