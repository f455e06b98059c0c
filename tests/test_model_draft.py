"""Draft layers: save -> load round trip, cache path = plain path, EAGLE-style checkpoints, misfits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_support import save_hf_model

import spectool
from spectool.model.draft_layer import DraftModel, DraftStyle, load_draft, save_draft


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    save_hf_model("qwen3", out, seed=7)
    return spectool.load(out)


def random_draft(cfg, num_layers: int, kind: str, seed: int = 0) -> DraftModel:
    torch.manual_seed(seed)
    draft = DraftModel(cfg, num_layers, kind)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    return draft


def run_layer(layer, target, tokens, hidden, cache=None, slots=None, starts=None):
    T = tokens.shape[1]
    start = 0 if starts is None else starts[:, None]
    positions = start + torch.arange(T).expand(tokens.shape[0], T)
    with torch.no_grad():
        emb = target.model.embed_tokens(tokens)
        return layer(emb, hidden, positions, cache, slots, starts)


def test_round_trip_and_cache_path(target, tmp_path):
    cfg, gen = target.config, torch.Generator().manual_seed(0)
    draft = random_draft(cfg, 3, "multi_layer_eagle")
    save_draft(draft, tmp_path / "mle")
    loaded = load_draft(tmp_path / "mle", target)
    assert loaded.kind == "multi_layer_eagle" and loaded.num_layers == 3
    want, got = draft.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)

    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
    hidden = torch.randn(2, 9, cfg.hidden_size, generator=gen)
    for k, layer in enumerate(loaded.layers):
        plain_feature, plain_normed = run_layer(draft.layers[k], target, tokens, hidden)
        # The same 9 tokens through the layer's own cache: 6 in one go, then 3 one at a time.
        cache = loaded.make_cache(k, max_batch=3, max_seq_len=16)
        assert cache.k.shape[0] == 1
        slots = torch.tensor([2, 0])
        parts = [run_layer(layer, target, tokens[:, :6], hidden[:, :6], cache, slots, torch.tensor([0, 0]))]
        for t in range(6, 9):
            parts.append(run_layer(layer, target, tokens[:, t:t + 1], hidden[:, t:t + 1], cache, slots,
                                   torch.tensor([t, t])))
        torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), plain_feature, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), plain_normed, atol=1e-5, rtol=0)


def test_chained_flag_round_trip_and_wiring(target, tmp_path):
    """A chained checkpoint keeps its flag; draft_chain feeds layer k the feature of layer k-1."""
    from spectool.train.draft import draft_chain, target_view

    cfg = target.config
    draft = random_draft(cfg, 2, "multi_layer_eagle")
    draft.chained = True
    save_draft(draft, tmp_path / "chained")
    save_draft(draft, tmp_path / "plain", chained=False)
    assert load_draft(tmp_path / "chained", target).chained
    assert not load_draft(tmp_path / "plain", target).chained

    tokens = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        view = target_view(target, tokens)
        got = [(f, logits) for _, f, logits in draft_chain(draft, target, view, 2)]
        positions = torch.arange(1, 10)[None]
        f0, _ = draft.layers[0](view.emb[:, 1:], view.hidden[:, :9], positions)
        f1, n1 = draft.layers[1](view.emb[:, 2:], f0[:, :8], positions[:, 1:])
    torch.testing.assert_close(got[0][0], f0)
    torch.testing.assert_close(got[1][0], f1)
    torch.testing.assert_close(got[1][1], target.model.lm_head(n1).float())


def test_chained_bad_input(target, tmp_path):
    with pytest.raises(ValueError, match="chained"):
        DraftModel(target.config, 1, "eagle", chained=True)
    save_draft(random_draft(target.config, 1, "multi_layer_eagle"), tmp_path / "d")
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps(meta | {"chained": "yes"}))
    with pytest.raises(ValueError, match="chained"):
        load_draft(tmp_path / "d", target)


def test_misfit_checkpoints(target, tmp_path):
    cfg = target.config
    save_draft(random_draft(cfg, 1, "eagle"), tmp_path / "ok")
    meta = json.loads((tmp_path / "ok" / "config.json").read_text())
    for field, value in [("hidden_size", 32), ("vocab_size", 50), ("head_dim", 8)]:
        d = tmp_path / field
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**meta, field: value}))
        (d / "model.safetensors").write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=field):
            load_draft(d, target)

    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    name = "layers.0.block.mlp.up_proj.weight"
    tensors.pop(name)
    save_file(tensors, tmp_path / "ok" / "model.safetensors")
    with pytest.raises(ValueError, match=name):
        load_draft(tmp_path / "ok", target)

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, tmp_path / "plain" / "model.safetensors")
    with pytest.raises(ValueError, match="spectool_draft"):
        load_draft(tmp_path / "plain", target)
    with pytest.raises(ValueError, match="kind"):
        save_draft(random_draft(cfg, 1, "eagle").layers, tmp_path / "x", kind="medusa")


def test_eagle_style_fc_checkpoint(target, tmp_path):
    """fc over [embedding; hidden] + a decoder layer without input norm, as EAGLE-1 ships them."""
    cfg, gen = target.config, torch.Generator().manual_seed(1)
    H, D, q, kv, I = cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"fc.weight": (H, 2 * H), "fc.bias": (H,), "embed_tokens.weight": (cfg.vocab_size, H),
              "layers.0.self_attn.q_proj.weight": (q, H), "layers.0.self_attn.k_proj.weight": (kv, H),
              "layers.0.self_attn.v_proj.weight": (kv, H), "layers.0.self_attn.o_proj.weight": (H, q),
              "layers.0.self_attn.q_norm.weight": (D,), "layers.0.self_attn.k_norm.weight": (D,),
              "layers.0.post_attention_layernorm.weight": (H,), "layers.0.mlp.gate_proj.weight": (I, H),
              "layers.0.mlp.up_proj.weight": (I, H), "layers.0.mlp.down_proj.weight": (H, I)}
    tensors = {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
                                                      "vocab_size": cfg.vocab_size, "num_hidden_layers": 1}))
    save_file(tensors, tmp_path / "model.safetensors")
    draft = load_draft(tmp_path, target)
    assert draft.kind == "eagle" and draft.num_layers == 1
    layer = draft.layers[0]
    assert layer.style == DraftStyle(input_norms=False, final_norm=False, block_input_norm=False,
                                     eh_bias=True)
    assert torch.equal(layer.eh_proj.weight, tensors["fc.weight"])
    assert torch.equal(layer.block.self_attn.qkv_proj.weight, torch.cat(
        [tensors[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))

    # Identity norms: the layer is fc -> block on the raw inputs (checked against a fresh block).
    tokens = torch.randint(0, cfg.vocab_size, (1, 5), generator=gen)
    hidden = torch.randn(1, 5, H, generator=gen)
    feature, normed = run_layer(layer, target, tokens, hidden)
    emb = target.model.embed_tokens(tokens)
    x = torch.cat([emb, hidden], -1) @ tensors["fc.weight"].T + tensors["fc.bias"]
    cos, sin = target.model.rope(torch.arange(5)[None], x.dtype)
    with torch.no_grad():
        torch.testing.assert_close(feature, layer.block(x, cos, sin, None), atol=1e-6, rtol=0)
    assert torch.equal(feature, normed)

    # A mismatched hidden size in the fc is named.
    tensors["fc.weight"] = torch.zeros(H, H)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="fc.weight"):
        load_draft(tmp_path, target)
