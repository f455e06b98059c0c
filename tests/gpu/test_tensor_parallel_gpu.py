"""Tensor parallelism on two GPUs (NCCL): the CPU tests' checks with the ranks on cuda:0 and cuda:1,
CUDA graphs (with the collectives inside them) on.

Oracle: the same checkpoint loaded whole (tp_size 1) on one GPU in this process.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

import tp_worker  # noqa: E402
from test_tensor_parallel import assert_same_steps, ranks, run_ranks  # noqa: E402


def test_split_logits_equal_whole_logits_on_two_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTOOL_TEST_DEVICE", "cuda")
    assert run_ranks("logits", tmp_path, SPECTOOL_TEST_DEVICE="cuda") == 0
    whole = tp_worker.forward_logits(1)
    for rank_result in ranks(tmp_path, "logits"):
        for phase in ("prefill", "decode", "verify"):
            # float32 on GPUs: TF32 is off by default, but the split sums round in another order.
            torch.testing.assert_close(torch.tensor(rank_result[phase]), torch.tensor(whole[phase]), atol=1e-4,
                                       rtol=1e-4, msg=f"{phase} logits at TP 2")


def test_greedy_speculative_output_at_tp2_on_two_gpus_equals_plain_output(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTOOL_TEST_DEVICE", "cuda")
    assert run_ranks("generate", tmp_path, SPECTOOL_TEST_DEVICE="cuda") == 0
    r0, r1 = ranks(tmp_path, "generate")
    whole = tp_worker.generate(1)
    plain = r0["none"]["tokens"]
    for method in ("ngram", "eagle", "multi_layer_eagle", "eagle3"):
        assert r0[method]["tokens"] == plain, f"{method} at TP 2 differs from plain decoding"
        assert r1[method]["tokens"] == r0[method]["tokens"], method
    assert r0["ngram"]["has_corpus"] and not r1["ngram"]["has_corpus"]
    for method, result in r0.items():
        assert result["recorded"] and result["tp_size"] == 2 and not r1[method]["recorded"], method
        if result["tokens"] == whole[method]["tokens"]:  # float32 near-ties may part the runs; else the same trace
            assert_same_steps(result["steps"], whole[method]["steps"], method)
