"""Deterministic mode off the GPU: which kernels a deterministic forward runs; that on the CPU the
flag is accepted (engine and command line), recorded in the trace, and changes nothing; and the
step-time benchmark's deterministic rows.

What the mode guarantees on CUDA (a token's logits the same bits in prefill, decode and tree
verify, any batch) is proved in tests/gpu/test_deterministic_gpu.py; its kernels against their
references and bit for bit alone vs in a batch, under the interpreter, in
test_kernels_batch_invariant.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_engine_support import cut_prompts, demo_token_streams

import spectool as st
from spectool.kernels import ops
from spectool.model.config import ModelConfig
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Transformer
from spectool.trace.reader import Trace


def tiny_model() -> Transformer:
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                      vocab_size=50, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    return Transformer(cfg).eval().requires_grad_(False)


def test_deterministic_forward_runs_only_the_invariant_projections_and_attention(monkeypatch):
    """With the CUDA condition lifted (spies stand in for the kernels, computing their torch
    references), a deterministic forward sends every projection (qkv, o, gate_up, down per layer,
    and the head) and every attention to kernels/batch_invariant.py, in prefill, decode and tree
    verify alike, and never reaches F.linear or SDPA; a default forward never calls them."""
    from spectool.kernels import batch_invariant as bi
    from spectool.kernels.attention_triton import cached_attention_reference
    from spectool.kernels.gemv import gemv_reference

    calls = {"linear": [], "attention": []}

    def linear_spy(x, weight, bias=None, prologue="none", residual=None, norm_weight=None, eps=1e-6, out_dtype=None):
        calls["linear"].append((prologue, residual is not None, out_dtype))
        return gemv_reference(x, weight, bias, prologue, residual, norm_weight, eps, out_dtype)

    def attention_spy(q, k_cache, v_cache, slots, starts, tree_mask=None):
        calls["attention"].append(q.shape[1])
        return cached_attention_reference(q, k_cache, v_cache, slots, starts, tree_mask)

    model = tiny_model()
    cfg = model.config
    cache = KVCache.for_model(cfg, 2, 32, torch.float32, torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 7))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    forwards = {  # name: (tokens, positions, starts, tree mask)
        "prefill": (tokens, torch.arange(7).expand(2, 7), torch.zeros(2, dtype=torch.long), None),
        "decode": (tokens[:, :1], torch.full((2, 1), 7), torch.full((2,), 7), None),
        "verify": (tokens[:, :4], torch.tensor([[7, 8, 8, 9]] * 2), torch.full((2,), 7), tree.expand(2, 4, 4)),
    }

    def run(deterministic: bool) -> dict[str, torch.Tensor]:
        out = {}
        with torch.no_grad():
            for name, (tok, pos, starts, mask) in forwards.items():
                hidden = model(tok, pos, cache=cache, slots=torch.arange(2), starts=starts, tree_mask=mask,
                               kv_len=int(starts.max()) + tok.shape[1], deterministic=deterministic)
                out[name] = model.logits(hidden, deterministic=deterministic)
        return out

    default = run(False)
    monkeypatch.setattr(ops, "_invariant", lambda x, weight=None: ops._DETERMINISTIC.get())
    monkeypatch.setattr(bi, "linear_invariant", linear_spy)
    monkeypatch.setattr(bi, "attention_invariant", attention_spy)
    assert run(False).keys() == default.keys() and calls == {"linear": [], "attention": []}

    def forbidden(*args, **kwargs):
        raise AssertionError("a deterministic forward reached a non-invariant kernel")

    monkeypatch.setattr(F, "linear", forbidden)
    monkeypatch.setattr(F, "scaled_dot_product_attention", forbidden)
    got = run(True)
    per_layer = [("rms_norm", False, None), ("none", False, None), ("rms_norm", True, None), ("silu_mul", False, None)]
    head = [("rms_norm", False, torch.float32)]
    # The first block's input norm has no residual; later blocks add the previous block's pair there.
    layers = per_layer + [("rms_norm", True, None)] + per_layer[1:]
    assert calls["linear"] == (layers + head) * 3
    assert calls["attention"] == [7, 7, 1, 1, 4, 4]
    for name in forwards:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], default[name], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 4, seed=24, min_len=8, max_len=40)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_deterministic_engine_on_cpu_changes_nothing_and_is_recorded(target, prompts, method):
    draft = None if method == "none" else st.NgramConfig(num_draft_tokens=6)
    runs = {}
    for deterministic in (False, True):
        engine = st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=96, deterministic=deterministic)
        assert engine.deterministic is deterministic
        runs[deterministic] = engine.generate(prompts, max_new_tokens=10, ignore_eos=True, record=True)
    assert runs[True].token_ids == runs[False].token_ids
    assert runs[True].trace.run_info["engine"]["deterministic"] is True
    assert runs[False].trace.run_info["engine"]["deterministic"] is False


def test_record_takes_deterministic(tmp_path, demo_model_dir):
    from spectool.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n")
    trace = tmp_path / "run.sptrace"
    assert main(["record", "--model", str(demo_model_dir / "target"), "--draft", "ngram", "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--device", "cpu", "--deterministic", "--out", str(trace)]) == 0
    assert Trace.load(trace).run_info["engine"]["deterministic"] is True


def test_step_times_deterministic_rows_follow_from_their_times(tmp_path):
    """benchmarks/step_times_8b.py --deterministic (CPU smoke mode): deterministic decode and verify
    times beside the default ones, and implied speedups that follow from them and the shared
    draft-layer times."""
    import importlib
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        module = importlib.import_module("step_times_8b")
        assert module.main(["--device", "cpu", "--quick", "--deterministic", "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(benchmarks)
    data = json.loads((tmp_path / "step_times_8b.json").read_text())
    times, det = data["times"], data["times"]["deterministic"]
    assert set(det["verify_us"]) == set(times["verify_us"])
    assert [r["method"] for r in data["deterministic_rows"]] == [r["method"] for r in data["rows"]]
    for r in data["deterministic_rows"]:
        draft = sum(times["draft_us"][str(t)] * c for t, c in r["draft_steps"])
        expected = (r["accept_length"] + 1) * det["decode_us"] / (det["verify_us"][str(r["N"])] + draft)
        assert r["implied_speedup"] == pytest.approx(expected)
