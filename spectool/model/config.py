"""ModelConfig: the fields of a Hugging Face config.json that the Llama-family decoder needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# architecture -> (q/k/v bias default, per-head q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),   # Qwen2 always has q/k/v biases
    "Qwen3ForCausalLM": (False, True),   # Qwen3 normalises q and k per head
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None  # not implemented: caches longer than this are refused
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {ROPE_TYPES}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x spelling)."""
        archs = hf.get("architectures") or []
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(f"config.json field 'architectures' is {archs!r}; "
                             f"supported: one of {', '.join(ARCHITECTURES)}")
        arch = archs[0]
        bias_default, qk_norm = ARCHITECTURES[arch]

        def need(name: str) -> Any:
            if name not in hf or hf[name] is None:
                raise ValueError(f"config.json has no field {name!r}")
            return hf[name]

        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json field 'hidden_act' is {hf['hidden_act']!r}; "
                             "only 'silu' is supported")
        if hf.get("mlp_bias"):
            raise ValueError("config.json field 'mlp_bias' is true; MLP biases are not supported")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = hf.get("head_dim") or hidden // num_heads

        # transformers 5 writes rope_parameters; 4.x and most hub checkpoints write rope_theta/rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}

        sliding = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            sliding = None
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", bias_default)) or bias_default,
            qk_norm=qk_norm,
            architecture=arch,
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a config.json file."""
        try:
            hf = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read config {path}: {e}") from e
        return cls.from_hf(hf)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for traces and draft checkpoints)."""
        return asdict(self)
