"""Deterministic mode on CUDA in bfloat16: a difference from plain decoding is a bug.

Oracles, each bit for bit (``torch.equal``), never to a tolerance:

(a) kernels: a row of the batch-invariant linear computed inside a call of M rows, at any
    position, equals that row computed alone (and the default mode's one-row GEMV); a query's
    attention output is the same from a prefill (alone, batched, continued after a prefix), a
    one-token decode at any batch position and a tree verify whose ancestors sit among siblings;
(b) the model: the demo target's float32 logits of a token are the same bits whether the token
    is computed in a prefill of its sequence alone, a batched right-padded prefill, a CUDA-graphed
    decode step at batch 1 or 3 (padded to a bucket of 4), or a CUDA-graphed tree verify at batch 1
    or 3, at any position of the batch; a control shows the default mode's kernels do differ there,
    so the comparison can fail;
(c) the engine: for every draft method, at batch sizes 1, 4 and 16, over prompts of mixed lengths
    (252 in all), deterministic greedy speculative output equals deterministic plain greedy output
    token for token, and plain output is the same at every batch size, with CUDA graphs on (and
    sampling in deterministic mode runs, repeating itself with its seed).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_engine_gpu import draft_config  # noqa: E402
from test_engine_support import cut_prompts, demo_token_streams  # noqa: E402
from test_kernels_batch_invariant import tree_mask_of  # noqa: E402

import spectool as st  # noqa: E402
from spectool.graphs import GraphRunner  # noqa: E402
from spectool.kernels import batch_invariant as bi  # noqa: E402
from spectool.kernels.attention_triton import cached_attention_reference  # noqa: E402
from spectool.kernels.gemv import gemv_triton  # noqa: E402
from spectool.model.kv_cache import KVCache  # noqa: E402

DT = torch.bfloat16


# ---------------------------------------------------------------------------------
# (a) kernels

LINEAR_CASES = [  # N, K, prologue, residual, float32 out: the 8B layer's projections and head, the demo's
    (6144, 4096, "rms_norm", True, False), (4096, 4096, "none", False, False),
    (28672, 4096, "rms_norm", True, False), (4096, 14336, "silu_mul", False, False),
    (128256, 4096, "rms_norm", False, True), (768, 256, "rms_norm", True, False), (256, 640, "silu_mul", False, False),
    (4096, 256, "rms_norm", False, True),
]


@pytest.mark.parametrize("n,k,prologue,with_residual,f32_out", LINEAR_CASES)
def test_linear_row_is_the_same_bits_at_any_batch_size_and_position(n, k, prologue, with_residual, f32_out):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    width = 2 * k if prologue == "silu_mul" else k
    m = 64 if n > 100_000 else 300
    x = torch.randn(m, width, device="cuda", generator=gen).to(DT)
    res = torch.randn(m, k, device="cuda", generator=gen).to(DT) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(DT) if prologue == "rms_norm" else None
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(DT)
    out_dtype = torch.float32 if f32_out else None

    def call(rows):
        return bi.linear_invariant(x[rows], w, None, prologue, None if res is None else res[rows], nw, 1e-5, out_dtype)

    probe = sorted({0, 1, 15, 16, 17, m // 2, m - 2, m - 1})
    alone = {i: call(slice(i, i + 1)) for i in probe}
    for i in probe[:3]:  # batch 1 runs the default mode's own kernel
        y_default, s_default = gemv_triton(x[i:i + 1], w, None, prologue, None if res is None else res[i:i + 1], nw,
                                           1e-5, out_dtype)
        assert torch.equal(alone[i][0], y_default) and (res is None or torch.equal(alone[i][1], s_default))
    for rows in (slice(0, m), slice(0, 2), slice(0, 16), slice(0, 17), slice(1, m - 1), slice(m // 2 - 3, m)):
        y, s = call(rows)
        for i in probe:
            if rows.start <= i < rows.stop:
                j = i - rows.start
                assert torch.equal(y[j], alone[i][0][0]), f"row {i} in rows {rows}"
                if res is not None:
                    assert torch.equal(s[j], alone[i][1][0])


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (32, 8, 128), (12, 4, 80)])
def test_attention_query_is_the_same_bits_in_prefill_decode_and_tree_verify(Hq, Hkv, D):
    gen = torch.Generator(device="cuda").manual_seed(Hq * D)
    L, max_seq = 1100, 1280  # 18 key blocks over the 16 split-KV programs: the first two get two each
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen).to(DT)  # noqa: E731
    k_seq, v_seq, q_seq = rnd(Hkv, L, D), rnd(Hkv, L, D), rnd(L, Hq, D)
    kc, vc = rnd(4, Hkv, max_seq, D), rnd(4, Hkv, max_seq, D)
    kc[1, :, :L], vc[1, :, :L] = k_seq, v_seq

    def run(q, slots, starts, mask=None):
        return bi.attention_invariant(q, kc, vc, torch.tensor(slots, device="cuda"),
                                      torch.tensor(starts, device="cuda"), mask)

    prefill = run(q_seq[None], [1], [0])[0]
    ref = cached_attention_reference(q_seq[None], kc, vc, torch.tensor([1]), torch.tensor([0]))[0]
    torch.testing.assert_close(prefill.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(run(torch.cat([rnd(1, L, Hq, D), q_seq[None]]), [3, 1], [0, 0])[1], prefill)
    assert torch.equal(run(q_seq[None, 900:], [1], [900])[0], prefill[900:])
    for p in (0, 1, 63, 64, 65, 1023, 1024, 1025, 1099):
        assert torch.equal(run(q_seq[None, p:p + 1], [1], [p])[0, 0], prefill[p]), p
    q5 = rnd(5, 1, Hq, D)
    q5[3, 0] = q_seq[1040]
    assert torch.equal(run(q5, [0, 2, 3, 1, 0], [10, 300, 7, 1040, 1200])[3, 0], prefill[1040])

    parents = [-1, 0, 0, 2, 1, 3, 3, 4, 6, 8, 0, 9, 5, 5, 11, 2]
    mask = tree_mask_of(parents).cuda()
    on_path = {0: 1020, 2: 1021, 3: 1022, 6: 1023, 8: 1024, 9: 1025, 11: 1026, 14: 1027}  # across block 16
    S, N = 1020, len(parents)
    kc[2, :, :S], vc[2, :, :S] = k_seq[:, :S], v_seq[:, :S]
    q_tree = rnd(1, N, Hq, D)
    for node, src in on_path.items():
        kc[2, :, S + node], vc[2, :, S + node], q_tree[0, node] = k_seq[:, src], v_seq[:, src], q_seq[src]
    alone = run(q_tree, [2], [S], mask[None])[0]
    other = tree_mask_of([-1, 0, 1, 1, 0, 4, 5, 2, 7, 0, 9, 9, 3, 12, 0, 14]).cuda()
    in_batch = run(torch.cat([rnd(2, N, Hq, D), q_tree]), [3, 0, 2], [100, 37, S], torch.stack([other, other, mask]))[2]
    for node, src in on_path.items():
        assert torch.equal(alone[node], prefill[src]), node
        assert torch.equal(in_batch[node], prefill[src]), node


# ---------------------------------------------------------------------------------
# (b) the demo target's logits

@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=DT)


def logits_comparisons(target, demo_model_dir, deterministic: bool) -> list[tuple[str, int, bool]]:
    """(what, position, bit-equal to the token's logits from a prefill of its sequence alone) for
    every token computed along the way."""
    model, cfg = target.model, target.config
    dev = torch.device("cuda")
    streams = [s for s in demo_token_streams(target, demo_model_dir) if len(s) >= 300]
    seqs = [streams[0][:300], streams[1][:170], streams[2][:41]]
    spare = 7
    cache = KVCache.for_model(cfg, spare + 1, 512, DT, dev)

    def forward(tokens, positions, slots, starts, mask=None):
        hidden = model(tokens, positions, cache=cache, slots=slots, starts=starts, tree_mask=mask,
                       deterministic=deterministic)
        return model.logits(hidden, deterministic=deterministic)

    def prefill(rows: list[list[int]], slots: list[int]) -> torch.Tensor:
        t = max(len(r) for r in rows)
        tokens = torch.tensor([r + [0] * (t - len(r)) for r in rows], device=dev)
        return forward(tokens, torch.arange(t, device=dev).expand(len(rows), t), torch.tensor(slots, device=dev),
                       torch.zeros(len(rows), dtype=torch.long, device=dev))

    def graphed(step):
        def fn(**inputs):  # the runner's warm-up and capture run under no_grad as the engine's do
            with torch.no_grad():
                return step(**inputs)
        return GraphRunner(fn, buckets=(1, 2, 4), enabled=True, pad_values={"slots": spare})

    out: list[tuple[str, int, bool]] = []
    with torch.no_grad():
        ref = [prefill([s], [0])[0].clone() for s in seqs]
        order = [2, 0, 1]
        batched = prefill([seqs[i] for i in order], [3, 1, 2])
        for row, i in enumerate(order):
            out += [("batched prefill", p, torch.equal(batched[row, p], ref[i][p])) for p in range(len(seqs[i]))]

        decode = graphed(lambda tokens, positions, slots, starts: forward(tokens, positions, slots, starts))
        for rows, slots in (([0, 1, 2], [1, 2, 3]), ([1], [4])):
            n = [len(seqs[i]) - 12 for i in rows]
            prefill([seqs[i][:k] for i, k in zip(rows, n)], slots)
            for step in range(12):
                pos = torch.tensor([[k + step] for k in n], device=dev)
                tokens = torch.tensor([[seqs[i][k + step]] for i, k in zip(rows, n)], device=dev)
                logits = decode(len(rows), tokens=tokens, positions=pos, slots=torch.tensor(slots, device=dev),
                                starts=pos[:, 0].contiguous())
                out += [(f"decode at batch {len(rows)}", k + step, torch.equal(logits[row, 0], ref[i][k + step]))
                        for row, (i, k) in enumerate(zip(rows, n))]

        # A tree after the prefix: the path 0 -> 2 -> 3 -> 6 carries the sequence's next tokens.
        parents = [-1, 0, 0, 2, 1, 3, 3, 4]
        path = {0: 0, 2: 1, 3: 2, 6: 3}  # node -> depth
        mask = tree_mask_of(parents).to(dev)
        depth = mask.sum(-1) - 1
        verify = graphed(lambda tokens, positions, slots, starts, mask: forward(tokens, positions, slots, starts, mask))
        gen = torch.Generator().manual_seed(0)
        for rows, slots in (([2, 0, 1], [5, 1, 3]), ([0], [6])):
            n = [len(seqs[i]) - 6 for i in rows]
            prefill([seqs[i][:k] for i, k in zip(rows, n)], slots)
            tokens = torch.randint(0, cfg.vocab_size, (len(rows), len(parents)), generator=gen)
            for row, (i, k) in enumerate(zip(rows, n)):
                for node, d in path.items():
                    tokens[row, node] = seqs[i][k + d]
            starts = torch.tensor(n, device=dev)
            logits = verify(len(rows), tokens=tokens.to(dev), positions=starts[:, None] + depth[None],
                            slots=torch.tensor(slots, device=dev), starts=starts,
                            mask=mask.expand(len(rows), -1, -1).contiguous())
            for row, (i, k) in enumerate(zip(rows, n)):
                out += [(f"tree verify at batch {len(rows)}", k + d, torch.equal(logits[row, node], ref[i][k + d]))
                        for node, d in path.items()]
        assert decode.stats["replays"] > 0 and verify.stats["replays"] > 0
    return out


def test_model_logits_are_the_same_bits_in_prefill_decode_and_verify(target, demo_model_dir):
    results = logits_comparisons(target, demo_model_dir, deterministic=True)
    differ = [(what, p) for what, p, equal in results if not equal]
    assert not differ, f"{len(differ)} of {len(results)} tokens' logits differ, first: {differ[:5]}"


def test_default_mode_differs_there_so_the_comparison_can_fail(target, demo_model_dir):
    """The control: the default kernels (cuBLAS for prefill and batches, the one-row GEMV at batch
    1, SDPA for long prompts) sum in other orders, and the same comparison sees it."""
    results = logits_comparisons(target, demo_model_dir, deterministic=False)
    assert any(not equal for _, _, equal in results)


# ---------------------------------------------------------------------------------
# (c) the engine: speculative output equals plain output, every method, batch 1 / 4 / 16

METHODS = ["ngram", "eagle", "multi_layer_eagle", "eagle3"]
PROMPTS_PER_BATCH = {1: 12, 4: 24, 16: 48}  # per method: 84, and 336 in all
MAX_NEW = 64
MAX_SEQ = 512


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    count = len(METHODS) * sum(PROMPTS_PER_BATCH.values())
    return cut_prompts(demo_token_streams(target, demo_model_dir), count, seed=2024, min_len=8,
                       max_len=MAX_SEQ - MAX_NEW - 32)


@pytest.fixture(scope="module")
def plain(target, prompts):
    engine = st.Engine(target, draft=None, max_batch_size=16, max_seq_len=MAX_SEQ, deterministic=True)
    return engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids


def share(method: str, batch: int) -> slice:
    """The prompts one (method, batch size) decodes: every prompt of the pool exactly once."""
    start = METHODS.index(method) * sum(PROMPTS_PER_BATCH.values())
    for b, n in PROMPTS_PER_BATCH.items():
        if b == batch:
            return slice(start, start + n)
        start += n
    raise KeyError(batch)


def first_differences(want: list[list[int]], got: list[list[int]]) -> list[tuple[int, int]]:
    """(prompt, first differing token) for every prompt whose outputs differ."""
    out = []
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            out.append((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_plain_output_is_the_same_at_every_batch_size(target, prompts, plain, batch):
    sl = share(METHODS[0], batch)
    engine = st.Engine(target, draft=None, max_batch_size=batch, max_seq_len=MAX_SEQ, deterministic=True)
    got = engine.generate(prompts[sl], max_new_tokens=MAX_NEW, ignore_eos=True, record=False).token_ids
    differ = first_differences(plain[sl], got)
    assert not differ, f"batch {batch} vs 16: {len(differ)} prompts differ, (prompt, token): {differ[:5]}"


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("method", METHODS)
def test_deterministic_speculative_output_equals_plain(target, demo_model_dir, prompts, plain, method, batch):
    sl = share(method, batch)
    engine = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=batch,
                       max_seq_len=MAX_SEQ, cuda_graphs=True, deterministic=True)
    # At batch 4 the recording variant of the greedy graph runs (it also packs the trace).
    result = engine.generate(prompts[sl], max_new_tokens=MAX_NEW, ignore_eos=True, record=batch == 4)
    differ = first_differences(plain[sl], result.token_ids)
    assert not differ, f"{method} at batch {batch}: {len(differ)} of {sl.stop - sl.start} prompts differ from " \
                       f"plain decoding, (prompt, token): {differ[:5]}"
    assert engine.graph_stats()["replays"] > 0
    assert result.stats.mean_accept_length > 0  # the drafts were used, not just the bonus tokens


def test_deterministic_sampling_runs_and_repeats_with_its_seed(target, demo_model_dir, prompts):
    """Sampling in deterministic mode (the graphed forward, then the eager sampling verify): valid
    tokens, and the same seed gives the same tokens."""
    engine = st.Engine(target, draft=draft_config("eagle", demo_model_dir), max_batch_size=4, max_seq_len=MAX_SEQ,
                       deterministic=True)
    runs = [engine.generate(prompts[:6], max_new_tokens=24, temperature=0.8, seed=5, ignore_eos=True,
                            record=False).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(out) == 24 and all(0 <= t < target.config.vocab_size for t in out) for out in runs[0])
