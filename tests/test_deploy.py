"""SGLang flags and vLLM speculative_config map to the spectool config docs/DEPLOYMENT.md states;
what cannot be honoured is refused by name (SGLang) or stated in a warning (vLLM)."""

from __future__ import annotations

import warnings

import pytest

import spectool as st
from spectool.cli import main
from spectool.deploy import DeploymentWarning


def no_warnings(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeploymentWarning)
        return fn(*args)


def test_sglang_ngram_flags():
    cfg = no_warnings(st.draft_from_sglang_args, [
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16",
        "--speculative-ngram-min-bfs-breadth=2", "--speculative-ngram-max-bfs-breadth", "8",
        "--speculative-ngram-max-trie-depth", "12", "--speculative-ngram-match-type", "PROB",
        "--speculative-ngram-capacity", "1000"])
    assert cfg == st.NgramConfig(num_draft_tokens=16, min_bfs_breadth=2, max_bfs_breadth=8, max_trie_depth=12,
                                 match="prob", capacity=1000)


@pytest.mark.parametrize("algorithm, kind", [("EAGLE", st.EagleConfig), ("EAGLE3", st.Eagle3Config),
                                             ("STANDALONE", st.DraftModelConfig)])
def test_sglang_tree_flags(algorithm, kind):
    cfg = no_warnings(st.draft_from_sglang_args, [
        "--speculative-algorithm", algorithm, "--speculative-draft-model-path", "/d",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"])
    assert cfg == kind("/d", num_steps=3, topk=2, num_draft_tokens=6)


def test_sglang_defaults_are_its_auto_choice_and_say_so():
    with pytest.warns(DeploymentWarning, match="--speculative-num-steps.*itself"):
        cfg = st.draft_from_sglang_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"])
    assert cfg == st.Eagle3Config("/d", num_steps=5, topk=4, num_draft_tokens=8)


@pytest.mark.parametrize("args, match", [
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d", "--speculative-token-map", "m.pt"],
     "--speculative-token-map cannot be honoured: .*hot-token"),
    (["--speculative-algorithm", "EAGLE", "--speculative-accept-threshold-single", "0.5"],
     "--speculative-accept-threshold-single cannot be honoured: relaxed acceptance is not lossless"),
    (["--speculative-algorithm", "NEXTN"], "--speculative-algorithm NEXTN cannot be honoured.*MTP"),
    (["--speculative-algorithm", "EAGLE", "--speculative-made-up", "1"], "--speculative-made-up has no spectool"),
    (["--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "2"], "--speculative-eagle-topk does not apply"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d",
      "--speculative-ngram-capacity", "9"], "--speculative-ngram-capacity applies only to"),
    (["--speculative-num-steps", "3"], "without --speculative-algorithm"),
    (["--model-path", "x"], "not an SGLang speculative-decoding flag"),
])
def test_sglang_flags_that_cannot_be_honoured_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        st.draft_from_sglang_args(args)


@pytest.mark.parametrize("method, kind", [("eagle", st.EagleConfig), ("eagle3", st.Eagle3Config),
                                          ("draft_model", st.DraftModelConfig)])
def test_vllm_chains(method, kind):
    cfg = no_warnings(st.draft_from_vllm_config, {"method": method, "model": "/d", "num_speculative_tokens": 5})
    assert cfg == kind("/d", num_steps=5, topk=1, num_draft_tokens=6)


def test_vllm_ngram_is_a_chain_and_says_so():
    with pytest.warns(DeploymentWarning, match="breadth 1"):
        cfg = st.draft_from_vllm_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 6})
    assert cfg == st.NgramConfig(max_bfs_breadth=1, min_bfs_breadth=1, max_trie_depth=10, num_draft_tokens=5)


@pytest.mark.parametrize("lookup, window, depth", [({}, "5..5", 8), ({"prompt_lookup_max": 4}, "4..4", 7),
                                                   ({"prompt_lookup_min": 2}, "2..2", 5)])
def test_vllm_ngram_lookup_defaults_are_vllms(lookup, window, depth):
    """vLLM sets both to 5 when neither is given, else the given one for both."""
    with pytest.warns(DeploymentWarning, match=f"suffix of {window} tokens"):
        cfg = st.draft_from_vllm_config({"method": "ngram", "num_speculative_tokens": 3, **lookup})
    assert cfg.max_trie_depth == depth


def test_vllm_settings_without_counterpart_are_stated():
    with pytest.warns(DeploymentWarning) as record:
        st.draft_from_vllm_config({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
                                   "draft_tensor_parallel_size": 1, "acceptance_method": "typical"})
    text = " ".join(str(w.message) for w in record)
    assert "draft_tensor_parallel_size" in text and "acceptance_method" in text


@pytest.mark.parametrize("config, match", [
    ({"method": "medusa", "model": "/d", "num_speculative_tokens": 3}, "method 'medusa' is not supported"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "eagle", "model": "/d"}, "num_speculative_tokens"),
])
def test_vllm_bad_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        st.draft_from_vllm_config(config)


def test_record_takes_sglang_flags(tmp_path, demo_model_dir, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    base = ["record", "--model", str(demo_model_dir / "target"), "--prompts", str(prompts), "--max-new-tokens", "4",
            "--device", "cpu", "--out", str(tmp_path / "t.sptrace")]
    sglang = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(demo_model_dir / "eagle"),
              "--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]
    assert main(base + sglang) == 0
    trace = st.Trace.load(tmp_path / "t.sptrace")
    assert trace.run_info["draft"]["method"] == "eagle" and trace.run_info["draft"]["num_draft_tokens"] == 4
    assert main(base + ["--speculative-algorithm", "NGRAM", "--speculative-token-map", "m.pt"]) == 2
    assert "--speculative-token-map cannot be honoured" in capsys.readouterr().err
    assert main(base + sglang + ["--draft", "ngram"]) == 2
    assert "not both" in capsys.readouterr().err
