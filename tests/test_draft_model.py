"""A standalone draft model: refused when its tokenizer or vocabulary differs from the target's,
taken from the command line, and drafting from its own cache (its own weights as the draft
accept every draft greedily)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

import spectool as st
from spectool.cli import main


@pytest.fixture(scope="module")
def swapped(demo_model_dir, tmp_path_factory):
    """The demo target with two tokens of its tokenizer's vocabulary swapped (ids 7 and 9)."""
    out = tmp_path_factory.mktemp("swapped") / "draft"
    shutil.copytree(demo_model_dir / "target", out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == k) for k in (7, 9))
    vocab[a], vocab[b] = 9, 7
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out, a, b


def test_a_different_tokenizer_is_refused_naming_the_first_differing_token(target, swapped):
    path, a, b = swapped
    with pytest.raises(ValueError, match=re.escape(f"token id 7 is {a!r} for the target and {b!r} for the draft")):
        st.Engine(target, draft=st.DraftModelConfig(path), max_seq_len=64)


def test_a_different_vocabulary_size_is_refused(target, demo_model_dir, tmp_path):
    from test_model_support import save_hf_model

    save_hf_model("llama", tmp_path / "other", vocab_size=target.config.vocab_size + 16)
    with pytest.raises(ValueError, match=r"vocabulary \(lm_head.weight, vocab_size\) has 4112 tokens"):
        st.Engine(target, draft=st.DraftModelConfig(tmp_path / "other"), max_seq_len=64)


def test_a_draft_without_tokenizer_cannot_be_checked(target, tmp_path):
    from test_model_support import save_hf_model

    save_hf_model("llama", tmp_path / "bare", vocab_size=target.config.vocab_size)
    with pytest.raises(ValueError, match="the draft model has no tokenizer.json"):
        st.Engine(target, draft=st.DraftModelConfig(tmp_path / "bare"), max_seq_len=64)


def test_record_with_the_target_as_its_own_draft_model(demo_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def fib(n):\n")
    out = tmp_path / "t.sptrace"
    assert main(["record", "--model", str(demo_model_dir / "target"), "--prompts", str(prompts), "--device", "cpu",
                 "--max-new-tokens", "12", "--draft", "draft_model", "--draft-path", str(demo_model_dir / "target"),
                 "--num-steps", "3", "--num-draft-tokens", "4", "--out", str(out)]) == 0
    trace = st.Trace.load(out)
    assert trace.run_info["draft"]["method"] == "draft_model"
    # Its own weights draft exactly what greedy decoding produces: every iteration accepts all three.
    lengths = [trace.iteration(i).accept_length for i in trace.iterations(0)]
    assert lengths[:-1] == [3] * (len(lengths) - 1)
