"""Safetensors reading and the mapping between Hugging Face tensor names and ours.

Our modules fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the
checkpoint stores them separately. A *layout* maps each of our tensor names to the
checkpoint tensors concatenated (dim 0) to make it, with their expected shapes, so
loading checks every tensor by its checkpoint name and saving splits them back.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from spectool.model.config import ModelConfig
from spectool.model.parallel import split_dim

Layout = dict[str, list[tuple[str, tuple[int, ...]]]]  # our name -> [(checkpoint name, shape), ...]


def block_layout(cfg: ModelConfig, ours: str, theirs: str) -> Layout:
    """Layout of one decoder block; ``ours``/``theirs`` are the name prefixes (ending in '.')."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    a, o = f"{ours}self_attn.", f"{theirs}self_attn."
    lay: Layout = {
        f"{ours}input_layernorm.weight": [(f"{theirs}input_layernorm.weight", (H,))],
        f"{a}qkv_proj.weight": [(f"{o}q_proj.weight", (q, H)), (f"{o}k_proj.weight", (kv, H)),
                                (f"{o}v_proj.weight", (kv, H))],
        f"{a}o_proj.weight": [(f"{o}o_proj.weight", (H, q))],
        f"{ours}post_attention_layernorm.weight": [(f"{theirs}post_attention_layernorm.weight", (H,))],
        f"{ours}mlp.gate_up_proj.weight": [(f"{theirs}mlp.gate_proj.weight", (I, H)),
                                           (f"{theirs}mlp.up_proj.weight", (I, H))],
        f"{ours}mlp.down_proj.weight": [(f"{theirs}mlp.down_proj.weight", (H, I))],
    }
    if cfg.qkv_bias:
        lay[f"{a}qkv_proj.bias"] = [(f"{o}q_proj.bias", (q,)), (f"{o}k_proj.bias", (kv,)),
                                    (f"{o}v_proj.bias", (kv,))]
    if cfg.qk_norm:
        lay[f"{a}q_norm.weight"] = [(f"{o}q_norm.weight", (D,))]
        lay[f"{a}k_norm.weight"] = [(f"{o}k_norm.weight", (D,))]
    return lay


def model_layout(cfg: ModelConfig) -> Layout:
    """Layout of a whole Hugging Face ``*ForCausalLM`` checkpoint."""
    V, H = cfg.vocab_size, cfg.hidden_size
    lay: Layout = {"embed_tokens.weight": [("model.embed_tokens.weight", (V, H))],
                   "norm.weight": [("model.norm.weight", (H,))]}
    for i in range(cfg.num_layers):
        lay.update(block_layout(cfg, f"layers.{i}.", f"model.layers.{i}."))
    if not cfg.tie_word_embeddings:
        lay["lm_head.weight"] = [("lm_head.weight", (V, H))]
    return lay


class SafetensorsDir:
    """Lazy access to the tensors of every *.safetensors file in a directory (sharded or not)."""

    def __init__(self, directory: str | Path, files: list[Path] | None = None):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if files is None and index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.dir / f for f in weight_map.values()})
        if files is None:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {self.dir}")
        self.files = files
        self._where: dict[str, Path] = {}
        for f in files:
            if not f.is_file():
                raise ValueError(f"weights file {f.name} (named in the index) is missing from {self.dir}")
            with safe_open(str(f), framework="pt") as st:
                self._where.update(dict.fromkeys(st.keys(), f))
        self._open: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        return self._file(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, without reading it."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def get_shard(self, name: str, dim: int, rank: int, size: int) -> torch.Tensor:
        """Part ``rank`` of ``size`` equal parts of tensor ``name`` along ``dim``; reads only that part."""
        part = self.shape(name)[dim] // size
        index = (slice(None),) * dim + (slice(rank * part, (rank + 1) * part),)
        return self._file(name).get_slice(name)[index]

    def _file(self, name: str):
        if name not in self._where:
            raise ValueError(f"checkpoint {self.dir} has no tensor {name!r}")
        f = self._where[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt")
        return self._open[f]

    def fingerprint(self) -> str:
        """A cheap, stable hash of the weights: every file's name, size, header and sampled bytes.

        Reads each file's safetensors header (names, dtypes, shapes, offsets) plus 16
        evenly spaced 4 KiB samples of its data, never the whole file, so two
        checkpoints of the same shapes but different weights hash differently, while an
        8B model still hashes in milliseconds. Not a cryptographic digest of every byte.
        """
        h = hashlib.sha256()
        for f in sorted(self.files):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(f.name.encode() + size.to_bytes(8, "little") + fh.read(n))
                data_start, chunk = 8 + n, 4096
                span = max(size - data_start - chunk, 0)
                for j in range(16):
                    fh.seek(data_start + span * j // 15)
                    h.update(fh.read(chunk))
        return h.hexdigest()


def gather(layout: Layout, get, dtype: torch.dtype, device: str | torch.device,
           shard=None) -> dict[str, torch.Tensor]:
    """Read every checkpoint tensor of ``layout`` via ``get(name)``, check its shape, fuse, cast.

    With ``shard = (weights, rank, size)`` (a :class:`SafetensorsDir` and a tensor-parallel
    place), the tensors that tensor parallelism splits are read as this rank's part only
    (``spectool.model.parallel.split_dim``), each checked against its whole shape first.
    """
    state = {}
    for ours, parts in layout.items():
        dim = None if shard is None else split_dim(ours)
        tensors = []
        for name, shape in parts:
            if dim is None:
                t = get(name)
                got = tuple(t.shape)
            else:
                weights, rank, size = shard
                got = weights.shape(name)
            if got != shape:
                raise ValueError(f"tensor {name!r} has shape {got}, expected {shape}")
            if dim is not None:
                t = weights.get_shard(name, dim, rank, size)
            tensors.append(t)
        fused = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        state[ours] = fused.to(device=device, dtype=dtype)
    return state


def split(layout: Layout, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`gather`: our fused tensors -> checkpoint-named tensors (contiguous, CPU)."""
    out = {}
    for ours, parts in layout.items():
        pieces = state[ours].detach().split([shape[0] for _, shape in parts], dim=0)
        for (name, _), piece in zip(parts, pieces):
            out[name] = piece.contiguous().cpu()
    return out
