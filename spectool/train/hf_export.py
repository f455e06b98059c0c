"""Save a trained Transformer as a Hugging Face Llama checkpoint (read by spectool and transformers)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from spectool.model.config import ModelConfig
from spectool.model.llama import Transformer
from spectool.model.weights import model_layout, split


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of a ``LlamaForCausalLM`` of ``cfg``'s shape (transformers 4.x and 5.x read it)."""
    if cfg.architecture != "LlamaForCausalLM" or cfg.qkv_bias or cfg.qk_norm:
        raise ValueError("only plain Llama targets are exported (no qkv bias, no q/k norm)")
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else (cfg.eos_token_ids or None)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def save_target(model: Transformer, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """Write config.json and model.safetensors (HF tensor names) for ``model``; returns the weight bytes.

    Files are written under temporary names and renamed, so a reader never sees half a checkpoint.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {name: t.to(dtype) for name, t in split(model_layout(cfg), model.state_dict()).items()}
    config = hf_config(cfg) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    save_file(tensors, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    (out / "config.json.tmp").write_text(json.dumps(config, indent=2))
    os.replace(out / "config.json.tmp", out / "config.json")
    return sum(t.numel() * t.element_size() for t in tensors.values())
