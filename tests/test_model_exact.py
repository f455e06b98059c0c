"""spectool's forwards give transformers' logits on the same weights (float32, CPU).

Oracle: the plain transformers forward over the same tokens (for a tree node: over
the prefix plus the node's root path).
"""

from __future__ import annotations

import pytest
import torch
from test_model_support import FAMILIES, random_tree, root_path, save_hf_model

import spectool
from spectool.model.kv_cache import KVCache

ATOL = 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(transformers model, spectool Target) on the same random weights."""
    out = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, out)
    return hf, spectool.load(out)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_config_fields_read(pair):
    hf, target = pair
    cfg = target.config
    assert cfg.head_dim == (getattr(hf.config, "head_dim", None)
                            or hf.config.hidden_size // hf.config.num_attention_heads)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (target.model.lm_head.weight is target.model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert cfg.qkv_bias == (cfg.architecture == "Qwen2ForCausalLM")
    assert cfg.qk_norm == (cfg.architecture == "Qwen3ForCausalLM")
    rope = hf.config.rope_parameters if hasattr(hf.config, "rope_parameters") else hf.config.rope_scaling
    if (rope or {}).get("rope_type", "default") == "llama3":
        assert cfg.rope_scaling["rope_type"] == "llama3"


def test_plain_forward(pair):
    hf, target = pair
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, target.config.vocab_size, (2, 11), generator=gen)
    logits = target.model.logits(target.model(tokens, torch.arange(11).expand(2, 11)))
    for b in range(2):
        torch.testing.assert_close(logits[b], hf_logits(hf, tokens[b].tolist()), atol=ATOL, rtol=0)


def test_prefill_then_decode(pair):
    """Prompts of different lengths prefilled together (right padding, odd slots), then T=1 decodes."""
    hf, target = pair
    model, V = target.model, target.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    lens = [5, 9, 2]
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in lens]
    cache = KVCache.for_model(target.config, max_batch=4, max_seq_len=32, dtype=torch.float32, device="cpu")
    slots = torch.tensor([2, 0, 3])
    T = max(lens)
    tokens = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    positions, starts = torch.arange(T).expand(3, T), torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        logits = model.logits(model(tokens, positions, cache, slots, starts, kv_len=T))
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b, :len(p)], hf_logits(hf, p), atol=ATOL, rtol=0)

    seqs = [list(p) for p in prompts]
    for step in range(3):
        new = torch.randint(0, V, (3, 1), generator=gen)
        starts = torch.tensor([len(s) for s in seqs])
        kv_len = None if step == 1 else int(starts.max()) + 1  # both the host and the no-sync path
        with torch.no_grad():
            logits = model.logits(model(new, starts[:, None], cache, slots, starts, kv_len=kv_len))
        for b in range(3):
            seqs[b].append(int(new[b, 0]))
            torch.testing.assert_close(logits[b, 0], hf_logits(hf, seqs[b])[-1], atol=ATOL, rtol=0)


def test_tree_verify_every_node(pair):
    """A tree of N nodes over each row's full prefix: node i's logits = forward over prefix + root path."""
    hf, target = pair
    model, V = target.model, target.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    prefix_lens, N = [6, 3], 8
    prefixes = [torch.randint(0, V, (n,), generator=gen).tolist() for n in prefix_lens]
    cache = KVCache.for_model(target.config, max_batch=2, max_seq_len=32, dtype=torch.float32, device="cpu")
    slots = torch.tensor([1, 0])
    for slot, p in zip(slots.tolist(), prefixes):  # prefill one row at a time
        s = torch.tensor([slot])
        model(torch.tensor([p]), torch.arange(len(p))[None], cache, s, torch.tensor([0]), kv_len=len(p))

    trees = [random_tree(N, gen) for _ in prefixes]
    node_tokens = torch.randint(0, V, (2, N), generator=gen)
    starts = torch.tensor(prefix_lens)
    positions = starts[:, None] + torch.tensor([depth for _, _, depth in trees])
    mask = torch.stack([m for _, m, _ in trees])
    with torch.no_grad():
        logits = model.logits(model(node_tokens, positions, cache, slots, starts, tree_mask=mask,
                                    kv_len=int(starts.max()) + N))
    for b, (parents, _, _) in enumerate(trees):
        for i in range(N):
            ids = prefixes[b] + node_tokens[b, root_path(parents, i)].tolist()
            torch.testing.assert_close(logits[b, i], hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_sharded_checkpoint(tmp_path):
    hf = save_hf_model("llama", tmp_path, seed=5, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    target = spectool.load(tmp_path)
    tokens = torch.arange(20)[None] % target.config.vocab_size
    logits = target.model.logits(target.model(tokens, torch.arange(20)[None]))
    torch.testing.assert_close(logits[0], hf_logits(hf, tokens[0].tolist()), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load(tmp_path, dtype):
    """Lower precision: weights in that dtype, logits close to float32 (loose: it is rounding)."""
    save_hf_model("qwen2", tmp_path, seed=6)
    ref, half = spectool.load(tmp_path), spectool.load(tmp_path, dtype=str(dtype).removeprefix("torch."))
    assert half.dtype == dtype
    assert all(p.dtype == dtype for p in half.model.parameters())
    tokens = torch.arange(12)[None] * 7 % ref.config.vocab_size
    positions = torch.arange(12)[None]
    want = ref.model.logits(ref.model(tokens, positions))
    got = half.model.logits(half.model(tokens, positions))
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()
