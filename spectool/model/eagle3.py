"""EAGLE-3 draft layers and their checkpoints (the format SpecForge writes and SGLang / vLLM serve).

The draft reads three of the target's layers: their hidden states (the residual stream after
each layer, before the final norm), concatenated to 3·H, go through ``fc`` to H at the root;
later draft steps read the draft's own feature instead. One decoder layer whose attention
takes ``[input_layernorm(embedding); hidden_norm(feature)]`` (2·H wide; the residual is the
feature), a final norm, and an ``lm_head`` over a reduced draft vocabulary whose ids map to
the target's by ``d2t`` (target id = draft id + d2t[draft id]). The token embedding is the
target's, as SGLang shares it.

Checkpoint directory: config.json with ``architectures: ["LlamaForCausalLMEagle3"]``, the
decoder's fields (hidden_size, num_attention_heads, ...), ``vocab_size`` (the target's),
``draft_vocab_size``, optional ``target_hidden_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` and optionally ``t2d`` (ignored) and
``embed_tokens.weight`` (ignored: the target's is used), in model.safetensors or
pytorch_model.bin.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from spectool.kernels import ops
from spectool.model.config import ModelConfig
from spectool.model.kv_cache import KVCache
from spectool.model.llama import MLP, Attention, RMSNorm, positions_at
from spectool.model.rope import RotaryEmbedding
from spectool.model.weights import SafetensorsDir, gather, split

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Names other tools give the same format.
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3Draft")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose outputs EAGLE-3 reads when its config names none: SGLang and vLLM
    capture the inputs of layers 2, L//2 and L-3, i.e. the outputs of layers 1, L//2-1, L-4."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3's default target layers need a target of at least 4 layers, got {num_layers}; "
                         "name them in the draft's config.json (eagle_config.eagle_aux_hidden_state_layer_ids)")
    return 1, num_layers // 2 - 1, num_layers - 4


class Eagle3Layer(nn.Module):
    """The EAGLE-3 draft: ``fc`` (applied by the caller at the root), one 2H-input decoder layer,
    the final norm and the draft-vocabulary head (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, draft_vocab_size: int, target_hidden_size: int | None = None,
                 rope: RotaryEmbedding | None = None):
        super().__init__()
        H = cfg.hidden_size
        self.config, self.draft_vocab_size = cfg, draft_vocab_size
        self.target_hidden_size = target_hidden_size or H
        self.fc = nn.Linear(3 * self.target_hidden_size, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn.qkv_proj = nn.Linear(2 * H, sum(self.self_attn.split), bias=False)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.rope = rope if rope is not None else RotaryEmbedding(cfg)

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target hidden states [.., 3·H_target] -> [.., H]."""
        return ops.linear(aux_hidden, self.fc.weight)

    def forward(self, tok_emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, slots: torch.Tensor | None = None,
                starts: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                kv_len: int | None = None, past: list | None = None,
                at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature [B,T,H] before the final norm, normed [B,T,H]) from the token embeddings and
        ``hidden`` (fc's output or a parent's feature); cache/slots/... as Transformer.forward.
        With ``at`` [B] both are [B,1,H], at that position of each row; the others only write
        their keys and values.

        ``past`` (training only, without a cache): the earlier draft steps' keys and values, for
        the attention of the training-time test (``_training_time_attention``); this step's are
        appended to it.
        """
        both = ops.rms_norm_pair(tok_emb, self.input_layernorm.weight, hidden, self.hidden_norm.weight,
                                 self.input_layernorm.eps)
        cos, sin = self.rope(positions, hidden.dtype)
        qkv = ops.linear(both, self.self_attn.qkv_proj.weight)
        if past is not None:
            attn = self._training_time_attention(qkv, cos, sin, past)
        else:
            attn = self.self_attn(qkv, cos, sin, None if cache is None else cache.layer(0), slots, starts,
                                  tree_mask, kv_len)
        if at is not None:
            attn, hidden = positions_at(attn, at), positions_at(hidden, at)
        gate_up, h = ops.rms_norm_linear(attn, hidden, self.post_attention_layernorm.weight,
                                         self.post_attention_layernorm.eps, self.mlp.gate_up_proj.weight, None)
        normed, feature = ops.add_rms_norm(self.mlp(gate_up), h, self.norm.weight, self.norm.eps)
        return feature, normed

    def _training_time_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 past: list) -> torch.Tensor:
        """Attention of draft step s = len(past) over a teacher-forced sequence, as the engine's step s sees it.

        Step s at index i drafts the token at position i+s+1. In the engine that query attends
        to the committed prefix, whose cache entries the root step wrote (from the target's
        layers through ``fc``), and to the draft path it extends, one entry per earlier step. So
        it attends here to the root step's keys at indices <= i and to steps 1..s's keys at index
        i alone (EAGLE-3's training-time test), not to step s's keys at earlier indices: those
        stand for features the engine never holds in its cache. ``past``: the earlier steps'
        (k, v) [B, T_step, kv_heads, D], RoPE applied, each step one index shorter; this step's
        are appended.
        """
        a = self.self_attn
        B, n, _ = qkv.shape
        q, k, v = qkv.split(a.split, dim=-1)
        q = a.q_norm(q.view(B, n, a.num_heads, a.head_dim))
        k = a.k_norm(k.view(B, n, a.num_kv_heads, a.head_dim))
        q, k = ops.rope(q, k, cos, sin)
        past.append((k, v.view(B, n, a.num_kv_heads, a.head_dim)))
        keys = torch.cat([pk[:, :n] for pk, _ in past], dim=1)
        values = torch.cat([pv[:, :n] for _, pv in past], dim=1)
        steps = len(past) - 1
        mask = None
        if steps:
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            mask = torch.cat([causal, *[torch.eye(n, dtype=torch.bool, device=q.device)] * steps], dim=1)
        out = ops.sdpa(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                       is_causal=not steps)
        return ops.linear(out.transpose(1, 2).reshape(B, n, -1), a.o_proj.weight)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the normed output (index them to target ids with ``d2t``)."""
        return ops.linear(normed, self.lm_head.weight)

    def make_cache(self, max_batch: int, max_seq_len: int) -> KVCache:
        w = self.fc.weight
        return KVCache.for_model(self.config, max_batch, max_seq_len, w.dtype, w.device, num_layers=1)


class Eagle3Draft(nn.Module):
    """An EAGLE-3 layer with the target layers it reads (``aux_layers``: their outputs, 0-based)."""

    def __init__(self, layer: Eagle3Layer, aux_layers: tuple[int, ...]):
        super().__init__()
        self.layer, self.aux_layers = layer, tuple(aux_layers)


def _layout(cfg: ModelConfig, draft_vocab: int, target_hidden: int) -> dict:
    """Our tensor name -> [(checkpoint name, shape), ...] (q/k/v and gate/up fused, as weights.py)."""
    H, D, Inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    m = "midlayer."
    return {
        "fc.weight": [("fc.weight", (H, 3 * target_hidden))],
        "input_layernorm.weight": [(f"{m}input_layernorm.weight", (H,))],
        "hidden_norm.weight": [(f"{m}hidden_norm.weight", (H,))],
        "self_attn.qkv_proj.weight": [(f"{m}self_attn.q_proj.weight", (q, 2 * H)),
                                      (f"{m}self_attn.k_proj.weight", (kv, 2 * H)),
                                      (f"{m}self_attn.v_proj.weight", (kv, 2 * H))],
        "self_attn.o_proj.weight": [(f"{m}self_attn.o_proj.weight", (H, q))],
        "post_attention_layernorm.weight": [(f"{m}post_attention_layernorm.weight", (H,))],
        "mlp.gate_up_proj.weight": [(f"{m}mlp.gate_proj.weight", (Inter, H)), (f"{m}mlp.up_proj.weight", (Inter, H))],
        "mlp.down_proj.weight": [(f"{m}mlp.down_proj.weight", (H, Inter))],
        "norm.weight": [("norm.weight", (H,))],
        "lm_head.weight": [("lm_head.weight", (draft_vocab, H))],
    }


def eagle3_evidence(meta: dict, names: set[str]) -> str | None:
    """What marks a checkpoint as EAGLE-3 (None if nothing does): its architecture, or tensors
    only EAGLE-3 has."""
    archs = meta.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return f"config.json architectures is {archs!r}"
    for name in ("d2t", "midlayer.hidden_norm.weight"):
        if name in names:
            return f"it has the tensor {name!r}"
    if "draft_vocab_size" in meta:
        return "config.json has draft_vocab_size"
    return None


class _BinDir:
    """The tensors of a pytorch_model.bin, with SafetensorsDir's interface."""

    def __init__(self, path: Path):
        self.dir = path.parent
        self._state = torch.load(path, map_location="cpu", weights_only=True)

    def names(self) -> set[str]:
        return set(self._state)

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def get(self, name: str) -> torch.Tensor:
        if name not in self._state:
            raise ValueError(f"checkpoint {self.dir} has no tensor {name!r}")
        return self._state[name]


def open_weights(root: Path) -> SafetensorsDir | _BinDir:
    """The checkpoint's tensors: *.safetensors, or a pytorch_model.bin where that is how it ships."""
    if not any(root.glob("*.safetensors")) and (root / "pytorch_model.bin").is_file():
        return _BinDir(root / "pytorch_model.bin")
    return SafetensorsDir(root)


def load_eagle3(path: str | Path, target) -> Eagle3Draft:
    """Load an EAGLE-3 checkpoint for ``target`` (a ``spectool.load`` Target).

    Raises:
        ValueError: not an EAGLE-3 checkpoint (an EAGLE-1/2 or spectool draft layer is named as
            such), a missing tensor, or one that does not fit the target (named).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"draft checkpoint {root} is not a directory")
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} has no config.json (an EAGLE-3 checkpoint has one with "
                         f"architectures {[ARCHITECTURE]})")
    meta = json.loads((root / "config.json").read_text())
    weights = open_weights(root)
    names = weights.names()
    if eagle3_evidence(meta, names) is None:
        why = ("config.json field 'spectool_draft' says it is a spectool draft layer" if "spectool_draft" in meta
               else f"config.json architectures is {meta.get('architectures')!r} and it has no d2t tensor"
               if "fc.weight" in names else "it has neither an EAGLE-3 architecture nor a d2t tensor")
        raise ValueError(f"{root} is not an EAGLE-3 checkpoint: {why}; use EagleConfig (--draft eagle) for "
                         "EAGLE-1/2 and spectool draft layers")
    if "fc.weight" in names and weights.get("fc.weight").shape[-1] == 2 * target.config.hidden_size:
        raise ValueError(f"{root} is an EAGLE-1/2 checkpoint, not EAGLE-3: tensor 'fc.weight' takes "
                         f"2 x hidden_size ({2 * target.config.hidden_size}) inputs, not 3 x; use EagleConfig")
    for flag, want in (("fc_norm", False), ("norm_output", True)):
        if meta.get(flag, want) != want:
            raise ValueError(f"{root}/config.json sets {flag}={meta[flag]!r}; spectool supports only {flag}={want}")
    tcfg = target.config
    hf = {**meta, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    try:
        cfg = ModelConfig.from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{root}/config.json: {e}") from e
    target_hidden = meta.get("target_hidden_size") or cfg.hidden_size
    if target_hidden != tcfg.hidden_size:
        raise ValueError(f"EAGLE-3 checkpoint {root} does not fit the target: tensor 'fc.weight' reads "
                         f"3 x target_hidden_size = 3 x {target_hidden}, the target's hidden size is "
                         f"{tcfg.hidden_size}")
    if cfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"EAGLE-3 checkpoint {root} does not fit the target: tensor "
                         f"'midlayer.input_layernorm.weight' normalises the target's token embedding, "
                         f"hidden_size {cfg.hidden_size} != the target's {tcfg.hidden_size}")
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"EAGLE-3 checkpoint {root} does not fit the target: tensor 't2d' / 'd2t' map a "
                         f"vocabulary of {cfg.vocab_size} (config.json vocab_size), the target's has {tcfg.vocab_size}")
    if "d2t" not in names:
        raise ValueError(f"EAGLE-3 checkpoint {root} has no tensor 'd2t' (draft id -> target id offsets)")
    d2t = weights.get("d2t")
    draft_vocab = meta.get("draft_vocab_size") or d2t.shape[0]
    if tuple(d2t.shape) != (draft_vocab,):
        raise ValueError(f"tensor 'd2t' has shape {tuple(d2t.shape)}, expected ({draft_vocab},) (draft_vocab_size)")
    mapped = torch.arange(draft_vocab) + d2t.long()
    if draft_vocab and (int(mapped.min()) < 0 or int(mapped.max()) >= tcfg.vocab_size):
        raise ValueError(f"tensor 'd2t' maps draft ids to target ids outside [0, {tcfg.vocab_size}) "
                         f"(got {int(mapped.min())}..{int(mapped.max())})")
    if "embed_tokens.weight" in names and tuple(weights.get("embed_tokens.weight").shape) != (
            tcfg.vocab_size, tcfg.hidden_size):
        raise ValueError(f"tensor 'embed_tokens.weight' has shape {tuple(weights.get('embed_tokens.weight').shape)}, "
                         f"the target's embedding is {(tcfg.vocab_size, tcfg.hidden_size)}")
    aux = _aux_layers(meta, tcfg.num_layers, root)
    same_rope = (cfg.rope_theta, cfg.rope_scaling) == (tcfg.rope_theta, tcfg.rope_scaling)
    rope = target.model.rope if same_rope else RotaryEmbedding(
        cfg, max_position=target.model.rope.max_position, device=target.device)
    with torch.device("meta"):
        layer = Eagle3Layer(cfg, draft_vocab, target_hidden, rope)
    state = gather(_layout(cfg, draft_vocab, target_hidden), weights.get, target.dtype, target.device)
    state["d2t"] = d2t.to(device=target.device, dtype=torch.long)
    missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
    assert not missing and not unexpected, (missing, unexpected)
    layer.rope = rope
    return Eagle3Draft(layer.eval().requires_grad_(False), aux)


def _aux_layers(meta: dict, num_layers: int, root: Path) -> tuple[int, ...]:
    """The target layers named by the checkpoint (as SpecForge writes them, under eagle_config, or at
    the top level), else the default three."""
    ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids",
                                               meta.get("eagle_aux_hidden_state_layer_ids"))
    if ids is None:
        return default_aux_layers(num_layers)
    if (not isinstance(ids, list) or len(ids) != 3 or any(not isinstance(i, int) or not 0 <= i < num_layers
                                                           for i in ids)):
        raise ValueError(f"{root}/config.json eagle_aux_hidden_state_layer_ids is {ids!r}: three target layer "
                         f"ids in [0, {num_layers}) are needed")
    return tuple(ids)


def save_eagle3(draft: Eagle3Draft, path: str | Path, t2d_vocab: int | None = None) -> None:
    """Write an EAGLE-3 draft in SpecForge's format (config.json + model.safetensors)."""
    layer, cfg = draft.layer, draft.layer.config
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = split(_layout(cfg, layer.draft_vocab_size, layer.target_hidden_size), layer.state_dict())
    d2t = layer.d2t.cpu()
    tensors["d2t"] = d2t
    vocab = t2d_vocab or cfg.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(layer.draft_vocab_size) + d2t] = True
    tensors["t2d"] = t2d
    meta = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": vocab,
        "draft_vocab_size": layer.draft_vocab_size, "target_hidden_size": layer.target_hidden_size,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft.aux_layers)},
    }
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    save_file(tensors, str(out / "model.safetensors"))


def new_eagle3(target_cfg: ModelConfig, draft_vocab_size: int | None = None, aux_layers=None,
               intermediate_size: int | None = None) -> Eagle3Draft:
    """A randomly initialised EAGLE-3 draft for a target of ``target_cfg`` (training, tests)."""
    cfg = dataclasses.replace(target_cfg, num_layers=1, qkv_bias=False, qk_norm=False, architecture="LlamaForCausalLM",
                              intermediate_size=intermediate_size or target_cfg.intermediate_size)
    layer = Eagle3Layer(cfg, draft_vocab_size or target_cfg.vocab_size)
    aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(target_cfg.num_layers)
    return Eagle3Draft(layer, aux)
