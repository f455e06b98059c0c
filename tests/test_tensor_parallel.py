"""Tensor parallelism on CPUs (gloo, 2 processes): the split target computes what the whole one does.

Oracle: the same checkpoint loaded whole (tp_size 1) in this process. Each TP run starts two
ranks of tests/tp_worker.py through spectool's own launcher, as `spectool record --tp 2` does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import tp_worker

import spectool as st
from spectool.cli.launch import CHILD_ENV, launch, launched
from spectool.kernels.topk import row_topk_torch
from spectool.model.config import ModelConfig
from spectool.model.parallel import check_divisible, shard_config
from spectool.verify import verify_greedy_torch

WORKER = Path(tp_worker.__file__)


def run_ranks(mode: str, out: Path, tp: int = 2, timeout_s: float = 300, **env) -> int:
    import os

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return launch([sys.executable, str(WORKER), mode, str(out), str(tp)], tp)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ranks(out: Path, mode: str, tp: int = 2) -> list[dict]:
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(tp)]


def test_split_logits_equal_whole_logits_for_prefill_decode_and_verify(tmp_path):
    assert run_ranks("logits", tmp_path) == 0
    whole = tp_worker.forward_logits(1)
    for rank_result in ranks(tmp_path, "logits"):
        for phase in ("prefill", "decode", "verify"):
            got, want = torch.tensor(rank_result[phase]), torch.tensor(whole[phase])
            assert got.shape == want.shape  # every rank holds the whole vocabulary's logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{phase} logits at TP 2")


def test_split_logits_equal_whole_logits_for_every_supported_family(tmp_path):
    from test_model_support import save_hf_model

    # Mistral (its own head_dim), Qwen2 (q/k/v biases, tied head) and Qwen3 (per-head q/k norms).
    paths = []
    for family in ("mistral", "qwen2", "qwen3"):
        save_hf_model(family, tmp_path / family, seed=5)
        paths.append(str(tmp_path / family))
    assert run_ranks("families", tmp_path, SPECTOOL_TEST_MODELS=json.dumps(paths)) == 0
    for rank_result in ranks(tmp_path, "families"):
        for path in paths:
            whole = tp_worker.forward_logits(1, path)
            for phase in ("prefill", "decode", "verify"):
                torch.testing.assert_close(torch.tensor(rank_result[path][phase]), torch.tensor(whole[phase]),
                                           atol=1e-5, rtol=1e-5, msg=f"{Path(path).name} {phase} logits at TP 2")


@pytest.mark.slow
def test_greedy_speculative_output_at_tp2_equals_plain_output(tmp_path):
    assert run_ranks("generate", tmp_path) == 0
    r0, r1 = ranks(tmp_path, "generate")
    whole = tp_worker.generate(1)
    plain = r0["none"]["tokens"]
    assert plain == whole["none"]["tokens"]  # TP 2 plain decoding = TP 1 plain decoding
    for method in ("ngram", "eagle", "multi_layer_eagle", "eagle3"):
        assert r0[method]["tokens"] == plain, f"{method} at TP 2 differs from plain decoding"
        assert r1[method]["tokens"] == r0[method]["tokens"]  # both ranks took the same decisions
    assert r0["ngram"]["has_corpus"] and not r1["ngram"]["has_corpus"]  # rank 1 drafts rank 0's broadcast trees
    for method, result in r0.items():  # rank 0 alone records, and says the target was split
        assert result["recorded"] and result["tp_size"] == 2, method
        assert not r1[method]["recorded"], method
        # The trace is the whole target's but for the recorded tp size: the same trees, decisions and
        # target top-k (merged from the slices), probabilities to float32 rounding.
        assert {**result["model"], "tp_size": 1} == whole[method]["model"], method
        assert_same_steps(result["steps"], whole[method]["steps"], method)


FLOAT_COLUMNS = ("scores", "step_topk_probs", "target_argmax_prob", "target_topk_probs", "coins", "temperature",
                 "child_probs", "bonus_cdf")


def assert_same_steps(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and got["iteration"], what
    for name, column in want.items():
        if name not in FLOAT_COLUMNS:
            assert got[name] == column, f"{what}: column {name}"
            continue
        for g, w in zip(got[name], column, strict=True):
            assert (g is None) == (w is None), f"{what}: column {name}"
            if w is not None:
                torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-6, rtol=1e-5, equal_nan=True,
                                           msg=f"{what}: column {name}")


def test_argmax_and_topk_from_the_slices_equal_those_of_the_whole_logits_without_joining_them(tmp_path):
    assert run_ranks("exchange", tmp_path) == 0
    r0, r1 = ranks(tmp_path, "exchange")
    vocab = st.load(st.demo_model() / "target").config.vocab_size
    logits = tp_worker.planted_logits(vocab, 2)
    want = verify_greedy_torch(tp_worker.planted_tree(logits), logits)
    for name, got in r0["decision"].items():  # ties go to the lowest id, as one argmax over the whole row
        assert got == getattr(want, name).tolist(), name
    for key, softmax in (("topk", True), ("raw_topk", False)):
        values, ids = row_topk_torch(logits, 5, softmax=softmax)
        assert r0[key][1] == ids.tolist(), key
        torch.testing.assert_close(torch.tensor(r0[key][0]), values, atol=1e-6, rtol=1e-6)
    assert r1["decision"] == r0["decision"] and r1["topk"] == r0["topk"]  # every rank decides the same

    # Greedy decoding with EAGLE drafts and recording exchanges a few numbers per row (at most the 2k + 1
    # of the recorded top-5), never a row of logits; sampling joins the logits, and the log shows it.
    rows = [shape[-1] for shape in r0["greedy_gathers"]]
    assert rows and max(rows) <= 2 * 5 + 1, rows
    assert vocab // 2 in [shape[-1] for shape in r0["sampling_gathers"]]
    # Sampling decides the same on every rank (joined logits, counter-based coins) and as the whole target.
    assert r0["sampled"] == r1["sampled"] == tp_worker.sample(tp_worker.eagle_engine(tp_worker.demo_target(1)))


def test_a_failing_rank_ends_the_run_with_its_error(tmp_path, capfd):
    start = time.monotonic()
    code = run_ranks("fail", tmp_path, SPECTOOL_TP_TIMEOUT_S="60")
    assert code != 0
    assert time.monotonic() - start < 50  # well before the collective's own timeout: no hang
    err = capfd.readouterr().err
    assert "planted failure on rank 1" in err and "rank 1 of 2 failed" in err


def test_tp_size_that_does_not_divide_the_model_is_refused_naming_what():
    cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=640, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match=r"tp_size 4 does not divide the model's key/value heads \(2\)"):
        check_divisible(cfg, 4)
    with pytest.raises(ValueError, match="vocabulary size"):
        check_divisible(ModelConfig(**{**cfg.__dict__, "vocab_size": 4097}), 2)
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 320, 2048)


def test_load_with_tp_outside_a_launch_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        st.load(st.demo_model() / "target", tp_size=2)
    with pytest.raises(ValueError, match="does not divide"):
        st.load(st.demo_model() / "target", tp_size=3)


def edited_target(dst: Path, **config) -> Path:
    """The demo target with some config fields changed (its weights linked, never read: the
    tensor-parallel checks come first)."""
    src = st.demo_model() / "target"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="asks for more GPUs than this machine has")
def test_bad_tp_input_is_refused_on_every_rank_before_any_work(tmp_path):
    demo = str(st.demo_model() / "target")
    kv1 = str(edited_target(tmp_path / "kv1", num_key_value_heads=1))
    odd_vocab = str(edited_target(tmp_path / "odd_vocab", vocab_size=4095))
    heads8 = str(edited_target(tmp_path / "heads8", num_attention_heads=8, num_key_value_heads=4))
    loads = [[kv1, "cpu", 2], [odd_vocab, "cpu", 2], [heads8, "cpu", 4], [demo, "cuda", 2]]
    want = [r"tp_size 2 does not divide the model's key/value heads \(1\)",
            r"tp_size 2 does not divide the model's vocabulary size \(4095\)",
            r"tp_size 4 does not match the launched world size 2",
            rf"tp_size 2 needs 2 GPUs; this machine has {torch.cuda.device_count()}"]
    assert run_ranks("refuse", tmp_path, SPECTOOL_TEST_LOADS=json.dumps(loads)) == 0
    for rank in ranks(tmp_path, "refuse"):
        for got, pattern in zip(rank["loads"], want, strict=True):
            assert got["error"] is not None and re.search(pattern, got["error"]), (got, pattern)
            assert not got["group"]  # refused before joining the process group: no rank waits


def test_mismatched_world_size_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="does not match the launched world size 4"):
        st.load(st.demo_model() / "target", tp_size=2)


def test_record_tp2_writes_the_trace_once(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def fibonacci(n):\nclass Stack:\n")
    out = tmp_path / "run.sptrace"
    proc = subprocess.run([sys.executable, "-m", "spectool", "record", "--model", str(st.demo_model() / "target"),
                           "--prompts", str(prompts), "--draft", "ngram", "--max-new-tokens", "12", "--device", "cpu",
                           "--tp", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("trace written") == 1
    trace = st.Trace.load(out)
    assert trace.run_info["model"]["tp_size"] == 2 and trace.requests.num_rows == 2


def test_ranks_started_by_torchrun_run_as_those_ranks(monkeypatch):
    monkeypatch.delenv(CHILD_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not launched()  # `spectool record --tp 2` alone: it starts the ranks
    monkeypatch.setenv("RANK", "1")  # under torchrun: this process is rank 1 and starts nothing
    assert launched()
