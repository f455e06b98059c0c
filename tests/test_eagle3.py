"""EAGLE-3 checkpoints: logits against SpecForge and an independent reference, the target layers
read, the drafter's chain, and bad input.

Oracles for the draft's logits (float32, random weights, within 1e-4):
- SpecForge's ``LlamaForCausalLMEagle3`` (the trainer that writes these checkpoints), saved in its
  own format and loaded by spectool. SpecForge pins torch==2.11.0 and sglang==0.5.14, which
  conflict with the test environment's torch, so it is not a test dependency: where it has been
  installed without its dependencies (``pip install --no-deps specforge``; it imports on a CPU)
  the test runs, elsewhere it is skipped, and
- always: ``reference_logits`` below, written from the checkpoint format alone (it reads the
  tensors by name from the files and shares nothing with spectool's modules).
The target-layer capture is checked against transformers' ``output_hidden_states``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_support import save_hf_model

import spectool as st
from spectool.model.eagle3 import default_aux_layers, load_eagle3, new_eagle3, save_eagle3

H, VOCAB, DRAFT_VOCAB, LAYERS = 32, 40, 24, 6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_target")
    hf = save_hf_model("llama", root, seed=4, vocab_size=VOCAB, hidden_size=H, intermediate_size=48,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)
    return root, hf


@pytest.fixture(scope="module")
def target(target_dir):
    return st.load(target_dir[0], device="cpu", dtype=torch.float32)


@pytest.fixture
def eager():
    """SpecForge compiles its RMSNorm with torch.compile; eager runs the same maths without a compiler."""
    with torch._dynamo.config.patch(disable=True):
        yield


def specforge_draft(seed: int):
    """A random SpecForge EAGLE-3 draft (every parameter randomised) and its config."""
    pytest.importorskip("specforge")
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=56, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=10000.0, pretraining_tp=1, hidden_act="silu",
                      pad_token_id=0, draft_vocab_size=DRAFT_VOCAB,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]})
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    torch.manual_seed(seed)
    model = LlamaForCausalLMEagle3(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
        # Draft id i stands for target id i + i // 2 (d2t holds the offsets).
        model.d2t.copy_(torch.arange(DRAFT_VOCAB) // 2)
    return model, cfg


def save_specforge(model, cfg, out, target_embedding: torch.Tensor) -> None:
    """Save as SpecForge does: config.json and the state dict (its frozen embedding is the target's)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    state["embed_tokens.weight"] = target_embedding.clone()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(cfg.to_json_string())


def format_checkpoint(out, seed: int, target_embedding: torch.Tensor, inter: int = 56) -> None:
    """A random EAGLE-3 checkpoint written from the format description (tensor names and shapes)."""
    gen = torch.Generator().manual_seed(seed)
    q, kv = 4 * 8, 2 * 8  # 4 query heads, 2 kv heads of 8

    def rand(*shape, norm=False):
        return (torch.rand(shape, generator=gen) + 0.5) if norm else torch.randn(shape, generator=gen) * 0.2

    m = "midlayer."
    tensors = {"fc.weight": rand(H, 3 * H), f"{m}input_layernorm.weight": rand(H, norm=True),
               f"{m}hidden_norm.weight": rand(H, norm=True), f"{m}self_attn.q_proj.weight": rand(q, 2 * H),
               f"{m}self_attn.k_proj.weight": rand(kv, 2 * H), f"{m}self_attn.v_proj.weight": rand(kv, 2 * H),
               f"{m}self_attn.o_proj.weight": rand(H, q), f"{m}post_attention_layernorm.weight": rand(H, norm=True),
               f"{m}mlp.gate_proj.weight": rand(inter, H), f"{m}mlp.up_proj.weight": rand(inter, H),
               f"{m}mlp.down_proj.weight": rand(H, inter), "norm.weight": rand(H, norm=True),
               "lm_head.weight": rand(DRAFT_VOCAB, H), "d2t": torch.arange(DRAFT_VOCAB) // 2,
               "t2d": torch.zeros(VOCAB, dtype=torch.bool), "embed_tokens.weight": target_embedding.clone()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": inter, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}))


def reference_logits(path, emb: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """The draft's logits [B, T, draft vocab] over a causal sequence at positions 0..T-1, from the
    format description: fc, then one decoder layer over [norm(emb); norm(fc out)] whose residual
    is the fc output, then the final norm and lm_head."""
    w = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    m = "midlayer."
    B, T, _ = emb.shape
    h = aux @ w["fc.weight"].T
    x = torch.cat([rms(emb, w[f"{m}input_layernorm.weight"]), rms(h, w[f"{m}hidden_norm.weight"])], dim=-1)
    q = (x @ w[f"{m}self_attn.q_proj.weight"].T).view(B, T, heads, d).transpose(1, 2)
    k = (x @ w[f"{m}self_attn.k_proj.weight"].T).view(B, T, kv_heads, d).transpose(1, 2)
    v = (x @ w[f"{m}self_attn.v_proj.weight"].T).view(B, T, kv_heads, d).transpose(1, 2)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rotate(t):  # rotate-half RoPE, as Llama
        a, b = t[..., : d // 2], t[..., d // 2:]
        return t * cos + torch.cat([-b, a], -1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * d) @ w[f"{m}self_attn.o_proj.weight"].T
    h = h + attn
    y = rms(h, w[f"{m}post_attention_layernorm.weight"])
    gate, up = y @ w[f"{m}mlp.gate_proj.weight"].T, y @ w[f"{m}mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w[f"{m}mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def spectool_logits(draft, target, tokens, aux):
    emb = target.model.embed_tokens(tokens)
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        _, normed = draft.layer(emb, draft.layer.project(aux), positions)
        return draft.layer.logits(normed)


def test_logits_match_a_reference_from_the_format(tmp_path, target):
    format_checkpoint(tmp_path / "eagle3", 3, target.model.embed_tokens.weight)
    draft = load_eagle3(tmp_path / "eagle3", target)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, 11), generator=gen)
    aux = torch.randn(2, 11, 3 * H, generator=gen)
    ours = spectool_logits(draft, target, tokens, aux)
    with torch.no_grad():
        ref = reference_logits(tmp_path / "eagle3", target.model.embed_tokens(tokens), aux)
    assert ours.shape == ref.shape == (2, 11, DRAFT_VOCAB)
    assert (ours - ref).abs().max().item() < 1e-4
    assert draft.aux_layers == (0, 2, 4)
    assert torch.equal(torch.arange(DRAFT_VOCAB) + draft.layer.d2t, torch.arange(DRAFT_VOCAB) * 3 // 2)


def test_logits_match_specforge(tmp_path, target, eager):
    model, cfg = specforge_draft(seed=1)
    save_specforge(model, cfg, tmp_path / "eagle3", target.model.embed_tokens.weight)
    draft = load_eagle3(tmp_path / "eagle3", target)
    assert draft.aux_layers == (0, 2, 4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=gen)
    aux = torch.randn(2, 9, 3 * H, generator=gen)
    emb = target.model.embed_tokens(tokens)
    positions = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        _, normed = draft.layer(emb, draft.layer.project(aux), positions)
        ours = draft.layer.logits(normed)
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        theirs = model.lm_head(model(hidden_states=aux, inputs_embeds=model.embed_input_ids(tokens)))
    assert ours.shape == (2, 9, DRAFT_VOCAB)
    assert (ours - theirs).abs().max().item() < 1e-4
    want = torch.arange(DRAFT_VOCAB) + model.d2t
    assert torch.equal(torch.arange(DRAFT_VOCAB) + draft.layer.d2t, want)


def test_pytorch_model_bin_loads_the_same(tmp_path, target):
    format_checkpoint(tmp_path / "st", 2, target.model.embed_tokens.weight)
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "st" / "config.json", tmp_path / "bin")
    torch.save(load_file(tmp_path / "st" / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    a, b = load_eagle3(tmp_path / "st", target), load_eagle3(tmp_path / "bin", target)
    for (name, x), (_, y) in zip(a.layer.state_dict().items(), b.layer.state_dict().items()):
        assert torch.equal(x, y), name


def test_aux_capture_is_the_target_layers_output(target_dir, target):
    """The engine's aux hidden states are transformers' hidden_states[i + 1] of the named layers."""
    _, hf = target_dir
    tokens = torch.tensor([[1, 5, 7, 2, 9, 11]])
    with torch.no_grad():
        hidden, aux = target.model(tokens, torch.arange(6)[None], aux_layers=(1, 2, 4))
        ref = hf(tokens, output_hidden_states=True).hidden_states
    want = torch.cat([ref[2], ref[3], ref[5]], dim=-1)
    assert (aux - want).abs().max().item() < 1e-4
    assert default_aux_layers(LAYERS) == (1, 2, 2)  # SGLang's capture before layers 2, L//2, L-3


def _write(tmp_path, name, target, mutate=None, meta_update=None):
    draft = new_eagle3(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layers=(0, 2, 4))
    path = tmp_path / name
    save_eagle3(draft, path)
    if mutate is not None:
        tensors = load_file(path / "model.safetensors")
        mutate(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    if meta_update is not None:
        meta = json.loads((path / "config.json").read_text())
        meta_update(meta)
        (path / "config.json").write_text(json.dumps(meta))
    return path


def test_eagle3_checkpoint_given_as_eagle_is_refused(tmp_path, target):
    path = _write(tmp_path, "e3", target)
    with pytest.raises(ValueError, match="is an EAGLE-3 checkpoint.*architectures.*Eagle3Config"):
        st.Engine(target, draft=st.EagleConfig(path, num_steps=2, topk=2, num_draft_tokens=4), max_seq_len=64)
    # Without its config's architecture the d2t tensor still gives it away.
    path = _write(tmp_path, "e3_noarch", target, meta_update=lambda m: (m.pop("architectures"),
                                                                          m.pop("draft_vocab_size")))
    with pytest.raises(ValueError, match="'d2t'"):
        st.Engine(target, draft=st.EagleConfig(path, num_steps=2, topk=2, num_draft_tokens=4), max_seq_len=64)


def test_eagle_checkpoint_given_as_eagle3_is_refused(tmp_path, target):
    from spectool.model.draft_layer import DraftModel, save_draft

    save_draft(DraftModel(target.config, 1, "eagle"), tmp_path / "eagle")
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint.*spectool_draft"):
        st.Engine(target, draft=st.Eagle3Config(tmp_path / "eagle", num_steps=2, topk=2, num_draft_tokens=4))
    # An EAGLE-1/2 fc checkpoint that claims the EAGLE-3 architecture: fc.weight's width gives it away.
    e1 = tmp_path / "eagle1"
    e1.mkdir()
    save_file({"fc.weight": torch.zeros(H, 2 * H), "d2t": torch.zeros(VOCAB, dtype=torch.long)},
              str(e1 / "model.safetensors"))
    (e1 / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                "hidden_size": H, "vocab_size": VOCAB,
                                                "intermediate_size": 48, "num_attention_heads": 4}))
    with pytest.raises(ValueError, match="EAGLE-1/2 checkpoint.*'fc.weight' takes 2 x hidden_size"):
        st.Engine(target, draft=st.Eagle3Config(e1, num_steps=2, topk=2, num_draft_tokens=4))


@pytest.mark.parametrize("mutate, meta_update, match", [
    (lambda t: t.pop("midlayer.hidden_norm.weight"), None, "no tensor 'midlayer.hidden_norm.weight'"),
    (lambda t: t.pop("d2t"), None, "no tensor 'd2t'"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(DRAFT_VOCAB, H + 2)}), None, "'lm_head.weight' has shape"),
    (None, lambda m: m.update(vocab_size=VOCAB + 8), "vocabulary of 48"),
    (None, lambda m: m.update(target_hidden_size=H * 2), "'fc.weight' reads 3 x target_hidden_size"),
    (None, lambda m: m.update(hidden_size=H * 2, head_dim=8), "'midlayer.input_layernorm.weight'"),
    (lambda t: t.update({"d2t": t["d2t"] + VOCAB}), None, "'d2t' maps draft ids to target ids outside"),
    (None, lambda m: m["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 9]),
     "eagle_aux_hidden_state_layer_ids"),
])
def test_checkpoint_that_does_not_fit_is_refused(tmp_path, target, mutate, meta_update, match):
    path = _write(tmp_path, "bad", target, mutate, meta_update)
    with pytest.raises(ValueError, match=match):
        load_eagle3(path, target)


def test_engine_chain_equals_a_reference_without_cache(tmp_path, target):
    """The drafter's top-1 chain (KV cache, graph-shaped steps) equals the draft run over the whole
    sequence without a cache, each step appending (the last draft, the last feature)."""
    torch.manual_seed(5)
    draft = new_eagle3(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layers=(0, 2, 4))
    with torch.no_grad():
        draft.layer.d2t.copy_(torch.arange(DRAFT_VOCAB) // 2)
        for name, p in draft.layer.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
        # The embedding's share of the input dominates: each step's token depends on the last one.
        draft.layer.input_layernorm.weight.mul_(4.0)
    save_eagle3(draft, tmp_path / "e3")
    steps = 4
    engine = st.Engine(target, draft=st.Eagle3Config(tmp_path / "e3", num_steps=steps, topk=1,
                                                     num_draft_tokens=steps + 1), max_seq_len=64)
    prompts = [[3, 17, 5, 9, 22, 1, 30], [8, 8, 2, 39, 14]]
    result = engine.generate(prompts, max_new_tokens=3, ignore_eos=True, record=True)
    layer = load_eagle3(tmp_path / "e3", target).layer
    ids = torch.arange(DRAFT_VOCAB) + layer.d2t
    for r, prompt in enumerate(prompts):
        row = result.trace.iteration(0, request=r)
        seq = torch.tensor([prompt + [int(row.tokens[0])]])  # the prompt and the root
        n = len(prompt)
        with torch.no_grad():
            _, aux = target.model(seq, torch.arange(n + 1)[None], aux_layers=(0, 2, 4))
            emb = target.model.embed_tokens(seq[:, 1:])
            hidden = layer.project(aux[:, :n])
            chain = []
            for _ in range(steps):
                feature, normed = layer(emb, hidden, torch.arange(1, emb.shape[1] + 1)[None])
                token = ids[layer.logits(normed[:, -1]).argmax(-1)]
                chain.append(int(token))
                emb = torch.cat([emb, target.model.embed_tokens(token)[:, None]], dim=1)
                hidden = torch.cat([hidden, feature[:, -1:]], dim=1)
        assert row.tokens[1:].tolist() == chain, f"request {r}"
