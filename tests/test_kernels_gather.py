"""The row-gather kernels (token embedding, KV commit) against their torch references.

The Triton kernels run on CPU through the Triton interpreter: unless this process started
with TRITON_INTERPRET=1, the file re-runs itself in a child pytest that does (conftest.py).
Both are pure copies, so every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spectool.kernels import gather
from spectool.verify import commit_kv

in_interpreter = pytest.mark.triton_interpreter  # skipped here, run by the launcher below (conftest.py)


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


# --- helpers ---------------------------------------------------------------------------------


def random_paths(bs: int, n: int, width: int, g: torch.Generator,
                 lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid accept paths of trees with ``n`` nodes: [bs, width] int64 (root 0 first, strictly
    increasing node indices, -1 past the length) and lengths [bs] in 0..width-1."""
    if lengths is None:
        lengths = torch.randint(0, width, (bs,), generator=g).tolist()
    path = torch.full((bs, width), -1, dtype=torch.long)
    for b, length in enumerate(lengths):
        chosen = torch.randperm(n - 1, generator=g)[:length] + 1
        path[b, : length + 1] = torch.cat([torch.zeros(1, dtype=torch.long), chosen.sort().values])
    return path, torch.tensor(lengths, dtype=torch.long)


def commit_by_loop(k: torch.Tensor, v: torch.Tensor, slots, seq_lens, path, length) -> None:
    """The commit spelt out entry by entry, reading a copy of each row taken before any write."""
    for b, slot in enumerate(slots.tolist()):
        s = int(seq_lens[b])
        for cache in (k, v):
            before = cache[:, slot].clone()
            for j in range(int(length[b]) + 1):
                cache[:, slot, :, s + j] = before[:, :, s + int(path[b, j])]


def random_cache(layers, slots, heads, seq, dim, dtype, g):
    k = torch.randn(layers, slots, heads, seq, dim, generator=g).to(dtype)
    return k, torch.randn(layers, slots, heads, seq, dim, generator=g).to(dtype)


# --- references (no interpreter needed) ------------------------------------------------------


def test_commit_reference_equals_the_entry_by_entry_loop():
    g = torch.Generator().manual_seed(0)
    k, v = random_cache(2, 6, 3, 40, 8, torch.float32, g)
    slots = torch.tensor([4, 1, 5, 0])
    seq_lens = torch.tensor([0, 7, 40 - 12, 20])
    path, length = random_paths(4, 12, 6, g, lengths=[0, 5, 5, 3])
    want_k, want_v = k.clone(), v.clone()
    commit_by_loop(want_k, want_v, slots, seq_lens, path, length)
    gather.commit_kv_torch(k, v, slots, seq_lens, path, length)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_overlapping_path_reads_before_it_writes():
    # Path [0, 2, 3]: j = 1 reads index s+2, which j = 2 writes; the result must hold the old s+2.
    k = torch.arange(10.0).view(1, 1, 1, 10, 1)
    v = -k
    commit_kv(k, v, torch.tensor([0]), torch.tensor([4]), torch.tensor([[0, 2, 3, -1]]), torch.tensor([2]))
    assert k.flatten().tolist() == [0, 1, 2, 3, 4, 6, 7, 7, 8, 9]
    assert torch.equal(v, -k)


def test_model_embedding_keeps_its_parameter_and_tied_head():
    from spectool.model.config import ModelConfig
    from spectool.model.llama import Embedding, Transformer

    cfg = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    model = Transformer(cfg)
    assert isinstance(model.embed_tokens, Embedding) and isinstance(model.embed_tokens, nn.Embedding)
    assert "embed_tokens.weight" in model.state_dict()
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = torch.tensor([[3, 3, 49, 0]])
    assert torch.equal(model.embed_tokens(ids), model.embed_tokens.weight[ids])
    with pytest.raises(IndexError):  # the torch path still raises on a bad id
        model.embed_tokens(torch.tensor([50]))


# --- Triton under the interpreter ------------------------------------------------------------


@in_interpreter
def test_kernels_really_run_in_the_interpreter():
    assert type(gather._embedding_kernel).__name__ == "InterpretedFunction"
    assert type(gather._commit_kv_kernel).__name__ == "InterpretedFunction"


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 200, 768, 1500])
def test_embedding_matches_reference(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    vocab = 97
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    for shape in [(1, 1), (1, 16), (3, 5), (16,), (2, 3, 4)]:
        ids = torch.randint(0, vocab, shape, generator=g)
        ids.view(-1)[-1] = ids.view(-1)[0]  # a repeated id in every batch
        got = gather.embedding_triton(ids, weight)
        assert got.dtype == dtype and torch.equal(got, gather.embedding_torch(ids, weight)), shape


@in_interpreter
def test_embedding_of_strided_int32_and_empty_ids():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 48, generator=g)
    buf = torch.randint(0, 40, (4, 9), generator=g)
    for ids in (buf[:, 2:3], buf[:, ::2], buf.t(), buf.to(torch.int32), buf[1, 3]):
        assert torch.equal(gather.embedding_triton(ids, weight), weight[ids.long()])
    empty = gather.embedding_triton(torch.zeros(2, 0, dtype=torch.long), weight)
    assert empty.shape == (2, 0, 48)


@in_interpreter
def test_embedding_clamps_out_of_range_ids():
    weight = torch.randn(10, 32)
    got = gather.embedding_triton(torch.tensor([[-1, 10, 3, -(2**40), 2**40]]), weight)
    assert torch.equal(got[0], weight[[0, 9, 3, 0, 9]])


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers,heads,dim,n,width", [(1, 1, 8, 5, 3), (3, 2, 64, 16, 6), (2, 4, 24, 33, 9),
                                                      (2, 2, 16, 48, 40)])
def test_commit_matches_reference(dtype, layers, heads, dim, n, width):
    g = torch.Generator().manual_seed(n * width)
    max_batch, seq = 7, 96
    k, v = random_cache(layers, max_batch, heads, seq, dim, dtype, g)
    slots = torch.tensor([5, 0, 3, 6, 2])  # a subset of the slots, out of order
    # Every accept length 0..width-1 appears; seq_lens include a tree ending at the cache's end.
    lengths = [i % width for i in range(len(slots))]
    lengths[-1] = width - 1
    path, length = random_paths(len(slots), n, width, g, lengths)
    seq_lens = torch.randint(0, seq - n, (len(slots),), generator=g)
    seq_lens[-1] = seq - n
    seq_lens[0] = 0
    want_k, want_v = k.clone(), v.clone()
    gather.commit_kv_torch(want_k, want_v, slots, seq_lens, path, length)
    gather.commit_kv_triton(k, v, slots, seq_lens, path, length)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@in_interpreter
def test_commit_every_length_near_the_cache_end_through_verify():
    # commit_kv dispatches to Triton under the interpreter; the tree's last node sits at the
    # cache's last index, and width == n (a chain), so the deepest path reaches it.
    g = torch.Generator().manual_seed(7)
    n = width = 5
    seq = 24
    k, v = random_cache(2, width, 3, seq, 16, torch.float32, g)
    slots = torch.arange(width)
    path, length = random_paths(width, n, width, g, lengths=list(range(width)))
    seq_lens = torch.full((width,), seq - n)
    want_k, want_v = k.clone(), v.clone()
    commit_by_loop(want_k, want_v, slots, seq_lens, path, length)
    commit_kv(k, v, slots, seq_lens, path, length)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@in_interpreter
def test_commit_overlap_explicitly_and_with_separate_layouts():
    # k and v with different strides (v stored sequence-major), the overlapping path [0, 2, 3].
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 2, 12, 4, generator=g)
    v = torch.randn(2, 3, 12, 2, 4, generator=g).transpose(2, 3)
    assert k.stride() != v.stride() and v.stride(-1) == 1
    slots, seq_lens = torch.tensor([2]), torch.tensor([5])
    path, length = torch.tensor([[0, 2, 3, -1, -1]]), torch.tensor([2])
    old_k, want_k, want_v = k.clone(), k.clone(), v.clone()
    commit_by_loop(want_k, want_v, slots, seq_lens, path, length)
    gather.commit_kv_triton(k, v, slots, seq_lens, path, length)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # j = 1 took the old s+2 (not what j = 2 wrote there), j = 2 the old s+3.
    assert torch.equal(k[:, 2, :, 6], old_k[:, 2, :, 7]) and torch.equal(k[:, 2, :, 7], old_k[:, 2, :, 8])


@in_interpreter
def test_commit_of_nothing_changes_nothing():
    g = torch.Generator().manual_seed(4)
    k, v = random_cache(1, 2, 1, 8, 4, torch.float32, g)
    before = k.clone(), v.clone()
    path, length = torch.tensor([[0, -1, -1], [0, -1, -1]]), torch.tensor([0, 0])
    gather.commit_kv_triton(k, v, torch.tensor([0, 1]), torch.tensor([3, 5]), path, length)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])
    gather.commit_kv_triton(k, v, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                            torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert torch.equal(k, before[0])
