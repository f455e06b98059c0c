"""Draft layers (MTP / EAGLE block) and their checkpoints.

A draft layer turns (token embedding, target hidden state before the final norm)
into a feature for the next-next token: ``eh_proj([enorm(emb); hnorm(hidden)])``,
one decoder block of the target's architecture, then a final norm; logits come from
the target's lm_head on the normed output. Every layer has its own one-layer KVCache.

Multi-layer drafts may be *chained* (as DeepSeek-V3's MTP modules): layer k > 0 then reads
layer k-1's feature at the same index in place of the target hidden state, as EAGLE's
later steps read their own. Unchained layers all read the target's hidden state.

Checkpoint directory (what :func:`save_draft` writes and :func:`load_draft` reads):
config.json ``{"spectool_draft": "eagle" | "multi_layer_eagle", "num_layers": K,
"chained": bool (absent = false), "style": {...}, ...ModelConfig fields of the block}`` and model.safetensors with
``layers.{k}.enorm.weight, layers.{k}.hnorm.weight, layers.{k}.eh_proj.weight,
layers.{k}.block.<Hugging Face block names>, layers.{k}.norm.weight``.

EAGLE-style checkpoints (``fc.weight`` over [embedding; hidden] + ``layers.0.*`` or
``midlayer.*``) load into the same module with enorm/hnorm as identity, and with
no final norm / block input norm / fc bias exactly where the checkpoint has none.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from spectool.kernels import ops
from spectool.model.config import ModelConfig
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Block, RMSNorm
from spectool.model.loader import Target
from spectool.model.rope import RotaryEmbedding
from spectool.model.weights import SafetensorsDir, block_layout, gather, split

KINDS = ("eagle", "multi_layer_eagle")


@dataclass(frozen=True)
class DraftStyle:
    """Which optional parts a draft layer has (all True/False as trained by spectool)."""

    input_norms: bool = True       # enorm/hnorm are RMSNorms (False: identity, EAGLE-style)
    final_norm: bool = True        # norm before the shared lm_head (False: identity)
    block_input_norm: bool = True  # the block's input_layernorm (EAGLE-1 layer 0 has none)
    eh_bias: bool = False          # bias on eh_proj (EAGLE-1's fc has one)


class DraftLayer(nn.Module):
    """One draft layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, style: DraftStyle = DraftStyle(),
                 rope: RotaryEmbedding | None = None):
        super().__init__()
        H = cfg.hidden_size
        self.config, self.style = cfg, style
        self.enorm = RMSNorm(H, cfg.rms_norm_eps) if style.input_norms else nn.Identity()
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps) if style.input_norms else nn.Identity()
        self.eh_proj = nn.Linear(2 * H, H, bias=style.eh_bias)
        self.block = Block(cfg)
        if not style.block_input_norm:
            self.block.input_layernorm = nn.Identity()
        self.norm = RMSNorm(H, cfg.rms_norm_eps) if style.final_norm else nn.Identity()
        self.rope = rope if rope is not None else RotaryEmbedding(cfg)

    def forward(self, tok_emb: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                starts: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                kv_len: int | None = None, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature [B,T,H] before the norm, normed [B,T,H]); cache/slots/... as Transformer.forward.
        With ``at`` [B] both are [B,1,H], at that position of each row (``Block.forward_residual``)."""
        if self.style.input_norms:  # both norms written into one buffer: no concatenation
            both = ops.rms_norm_pair(tok_emb, self.enorm.weight, target_hidden, self.hnorm.weight, self.enorm.eps)
        else:
            both = torch.cat([tok_emb, target_hidden], dim=-1)
        x = ops.linear(both, self.eh_proj.weight, self.eh_proj.bias)  # the batch-invariant kernel in deterministic mode
        cos, sin = self.rope(positions, x.dtype)
        mlp_out, h = self.block.forward_residual(x, None, cos, sin, None if cache is None else cache.layer(0),
                                                 slots, starts, tree_mask, kv_len, at)
        if isinstance(self.norm, RMSNorm):  # the block's last residual add inside the final norm
            normed, feature = ops.add_rms_norm(mlp_out, h, self.norm.weight, self.norm.eps)
            return feature, normed
        feature = h + mlp_out
        return feature, feature


class DraftModel(nn.Module):
    """K draft layers of one kind, sharing the target's RoPE table.

    ``chained`` (multi-layer only): layer k > 0 reads layer k-1's feature instead of the
    target's hidden state (module docstring).
    """

    def __init__(self, cfg: ModelConfig, num_layers: int, kind: str, style: DraftStyle = DraftStyle(),
                 rope: RotaryEmbedding | None = None, chained: bool = False):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"draft kind must be one of {KINDS}, got {kind!r}")
        if num_layers < 1:
            raise ValueError(f"a draft model needs at least one layer, got {num_layers}")
        if chained and kind != "multi_layer_eagle":
            raise ValueError("only multi-layer drafts can be chained (EAGLE's steps always read their own feature)")
        rope = rope if rope is not None else RotaryEmbedding(cfg)
        self.config, self.kind, self.style, self.chained = cfg, kind, style, chained
        self.layers = nn.ModuleList(DraftLayer(cfg, style, rope) for _ in range(num_layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def make_cache(self, k: int, max_batch: int, max_seq_len: int) -> KVCache:
        """The single-layer KVCache of draft layer k, on that layer's device and dtype."""
        w = self.layers[k].eh_proj.weight
        return KVCache.for_model(self.config, max_batch, max_seq_len, w.dtype, w.device, num_layers=1)


def _layer_layout(layer: DraftLayer, k: int) -> dict:
    """Checkpoint layout of layer k (spectool format), restricted to the tensors the layer has."""
    p = f"layers.{k}."
    lay = {f"{p}{n}": [(f"{p}{n}", tuple(t.shape))] for n, t in layer.state_dict().items()
           if not n.startswith("block.")}
    lay.update(block_layout(layer.config, f"{p}block.", f"{p}block."))
    have = {f"{p}{n}" for n in layer.state_dict()}
    return {ours: parts for ours, parts in lay.items() if ours in have}


def save_draft(layers: DraftModel | Sequence[DraftLayer], path: str | Path, kind: str | None = None,
               chained: bool | None = None) -> None:
    """Write draft layers as config.json + model.safetensors (the format :func:`load_draft` reads).
    ``kind`` and ``chained`` default to the DraftModel's (a bare layer list: unchained)."""
    layer_list = list(layers.layers if isinstance(layers, DraftModel) else layers)
    kind = kind or (layers.kind if isinstance(layers, DraftModel) else None)
    if chained is None:
        chained = layers.chained if isinstance(layers, DraftModel) else False
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not layer_list:
        raise ValueError("no draft layers to save")
    cfg, style = layer_list[0].config, layer_list[0].style
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, layer in enumerate(layer_list):
        state = {f"layers.{k}.{n}": t for n, t in layer.state_dict().items()}
        tensors.update(split(_layer_layout(layer, k), state))
    skip = ("num_layers", "bos_token_id", "eos_token_ids")
    fields = {n: v for n, v in cfg.to_dict().items() if n not in skip}
    meta = {"spectool_draft": kind, "num_layers": len(layer_list), "chained": chained,
            "style": dataclasses.asdict(style),
            **fields}
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    save_file(tensors, str(out / "model.safetensors"))


def load_draft(path: str | Path, target: Target) -> DraftModel:
    """Load draft layers for ``target`` (spectool format, or an EAGLE-style fc checkpoint).

    Raises:
        ValueError: not a draft checkpoint, missing or misshaped tensors, or a checkpoint
            that does not fit the target (hidden size, vocabulary, head dim).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"draft checkpoint {root} is not a directory")
    meta = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else {}
    weights = SafetensorsDir(root)
    from spectool.model.eagle3 import eagle3_evidence

    why = eagle3_evidence(meta, weights.names())
    if why is not None:
        raise ValueError(f"{root} is an EAGLE-3 checkpoint ({why}), not an EAGLE-1/2 or spectool draft layer; "
                         "load it with Eagle3Config (--draft eagle3)")
    if "fc.weight" in weights:
        return _load_eagle_style(weights, meta, target)
    if meta.get("spectool_draft") not in KINDS:
        raise ValueError(f"{root} is not a draft checkpoint: config.json field 'spectool_draft' must be one "
                         f"of {KINDS} (or the weights an EAGLE-style fc.weight + decoder layer)")
    fields = {f.name: meta[f.name] for f in dataclasses.fields(ModelConfig) if f.name in meta}
    cfg = _fit(target.config, fields, root)
    num_layers = meta.get("num_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{root}/config.json field 'num_layers' must be a positive int, got {num_layers!r}")
    chained = meta.get("chained", False)
    if not isinstance(chained, bool):
        raise ValueError(f"{root}/config.json field 'chained' must be true or false, got {chained!r}")
    with torch.device("meta"):  # every tensor is assigned from the checkpoint below
        model = DraftModel(cfg, num_layers, meta["spectool_draft"], DraftStyle(**meta.get("style", {})),
                           target.model.rope, chained)
    for k, layer in enumerate(model.layers):
        state = gather(_layer_layout(layer, k), weights.get, target.dtype, target.device)
        _assign(layer, {n.removeprefix(f"layers.{k}."): t for n, t in state.items()})
    return model.eval().requires_grad_(False)


def _load_eagle_style(weights: SafetensorsDir, meta: dict, target: Target) -> DraftModel:
    prefix = "midlayer." if any(n.startswith("midlayer.") for n in weights.names()) else "layers.0."
    hf_names = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_attention_heads": "num_heads",
                "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps"}
    cfg = _fit(target.config, {ours: meta[hf] for hf, ours in hf_names.items() if meta.get(hf) is not None},
               weights.dir)
    style = DraftStyle(input_norms=False, final_norm="norm.weight" in weights,
                       block_input_norm=f"{prefix}input_layernorm.weight" in weights,
                       eh_bias="fc.bias" in weights)
    with torch.device("meta"):
        model = DraftModel(cfg, 1, "eagle", style, target.model.rope)
    layer = model.layers[0]
    H = cfg.hidden_size
    layout = {"eh_proj.weight": [("fc.weight", (H, 2 * H))], **block_layout(cfg, "block.", prefix)}
    if style.eh_bias:
        layout["eh_proj.bias"] = [("fc.bias", (H,))]
    if style.final_norm:
        layout["norm.weight"] = [("norm.weight", (H,))]
    if not style.block_input_norm:
        del layout["block.input_layernorm.weight"]
    _assign(layer, gather(layout, weights.get, target.dtype, target.device))
    return model.eval().requires_grad_(False)


def _fit(target_cfg: ModelConfig, fields: dict, where: str | Path) -> ModelConfig:
    """The draft block's config: the target's, overridden by the checkpoint's fields, checked to fit."""
    for name in ("hidden_size", "vocab_size", "head_dim"):
        if name in fields and fields[name] != getattr(target_cfg, name):
            raise ValueError(f"draft checkpoint {where} does not fit the target: {name} is {fields[name]}, "
                             f"the target's is {getattr(target_cfg, name)}")
    # RoPE comes from the target's table, so its settings are the target's.
    keep = {"num_layers", "rope_theta", "rope_scaling", "max_position_embeddings", "bos_token_id",
            "eos_token_ids", "tie_word_embeddings"}
    return dataclasses.replace(target_cfg, **{n: v for n, v in fields.items() if n not in keep})


def _assign(layer: DraftLayer, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``layer``, which must name exactly the same tensors."""
    missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"draft layer tensors do not match: missing {missing}, unexpected {unexpected}")
