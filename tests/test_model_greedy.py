"""A plain greedy loop over the static cache (batched prefill + T=1 decodes) equals transformers generate."""

from __future__ import annotations

import pytest
import torch
from test_model_support import hf_greedy, save_hf_model

import spectool
from spectool.model.kv_cache import KVCache


def greedy(target, cache: KVCache, slots: list[int], prompts: list[list[int]], n: int) -> list[list[int]]:
    """Prefill all prompts in one right-padded batch, then decode n-1 tokens one at a time."""
    model, B = target.model, len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    T = int(lens.max())
    slot_t = torch.tensor(slots)
    tokens = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    with torch.no_grad():
        hidden = model(tokens, torch.arange(T).expand(B, T), cache, slot_t, torch.zeros(B, dtype=torch.long),
                       kv_len=T)
        nxt = model.logits(hidden[torch.arange(B), lens - 1][:, None])[:, 0].argmax(-1)
        out, seq = [nxt], lens.clone()
        for _ in range(n - 1):
            hidden = model(nxt[:, None], seq[:, None], cache, slot_t, seq, kv_len=int(seq.max()) + 1)
            nxt = model.logits(hidden)[:, 0].argmax(-1)
            out.append(nxt)
            seq += 1
    return torch.stack(out, 1).tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    hf = save_hf_model("qwen3", out, seed=11)
    return hf, spectool.load(out)


def test_greedy_loop_matches_generate_and_reuses_slots(pair):
    hf, target = pair
    gen = torch.Generator().manual_seed(0)
    V, n = target.config.vocab_size, 12
    cache = KVCache.for_model(target.config, max_batch=3, max_seq_len=40, dtype=torch.float32, device="cpu")
    k_before = cache.k.data_ptr()
    rounds = [([4, 13], [1, 2]), ([7], [0]), ([3, 9, 15], [2, 0, 1])]  # batch sizes 2, 1, 3 on one cache
    for lens, slots in rounds:
        prompts = [torch.randint(0, V, (m,), generator=gen).tolist() for m in lens]
        got = greedy(target, cache, slots, prompts, n)
        assert got == [hf_greedy(hf, p, n) for p in prompts]
    assert cache.k.data_ptr() == k_before  # never reallocated
