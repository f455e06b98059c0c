"""Helpers shared by the model tests: tiny random transformers models of each family.

(Named test_model_* so it sits with the tests it serves; it holds no tests itself.)
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, rms_norm_eps=1e-6)

# name -> (config class, model class, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_scaled_tied": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random float32 transformers model of ``family``, every parameter (biases, norms) randomised."""
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def save_hf_model(family: str, out: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a random model of ``family`` to ``out``; returns the transformers model."""
    model = make_hf_model(family, seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return model


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``n`` new tokens."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_tree(n: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor, list[int]]:
    """Random topologically ordered tree of n nodes: parents, ancestor mask [n, n], depths."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        mask[i, i] = True
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
            depth[i] = depth[parents[i]] + 1
    return parents, mask, depth


def root_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
