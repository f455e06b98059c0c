"""Rotary position embedding tables (default, linear and llama3 frequency scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from spectool.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """The head_dim/2 rotation frequencies, float32, with the config's rope scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(in_band, blended, inv_freq)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position, computed once (float32 buffers).

    Gathering by a positions tensor needs no host sync, so it is safe inside CUDA graphs.
    """

    def __init__(self, cfg: ModelConfig, max_position: int | None = None, device: torch.device | None = None):
        super().__init__()
        self.max_position = max_position or cfg.max_position_embeddings
        where = torch.device(device) if device is not None else torch.get_default_device()
        # A model built on the meta device (the loader's, before it assigns the weights) gets its tables
        # computed on the CPU: arange on meta goes through torch's decompositions, whose first use imports
        # torch._dynamo, seconds of every load on a small CPU.
        at = torch.device("cpu") if where.type == "meta" else where
        angles = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=at),
                             inverse_frequencies(cfg, at))
        self.register_buffer("cos", angles.cos().to(where), persistent=False)  # [max_position, head_dim/2]
        self.register_buffer("sin", angles.sin().to(where), persistent=False)
        self._tables: dict[torch.dtype, torch.Tensor] = {}

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_position, 2, head_dim/2]: cos and sin side by side, cast once per dtype, so a
        forward gathers both with one kernel instead of a gather and a cast for each."""
        table = self._tables.get(dtype)
        if table is None or table.device != self.cos.device:
            with torch.inference_mode(False):  # also usable outside inference mode (training)
                table = torch.stack([self.cos, self.sin], dim=1).to(dtype)
            self._tables[dtype] = table
        return table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, head_dim/2] in ``dtype`` (as transformers casts them)."""
        both = self._table(dtype)[positions]
        return both[..., 0, :], both[..., 1, :]
