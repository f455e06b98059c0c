"""spectool.load: tokenizer, identity, eos ids, and clear errors for what it cannot load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_support import save_hf_model

import spectool
from spectool.model.loader import check_prompt


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", out, seed=3)
    return out


def copy_checkpoint(src, dst, edit_config=None, edit_tensors=None):
    """Copy a single-file checkpoint, optionally editing its config dict / tensor dict in place."""
    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if edit_config:
        edit_config(cfg)
    if edit_tensors:
        edit_tensors(tensors)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_tokenizer_and_identity(llama_dir, tmp_path):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "def", "fib", "(", "n", ")", ":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="isolated")])
    d = tmp_path / "with_tok"
    shutil.copytree(llama_dir, d)  # byte-identical weights
    tok.save(str(d / "tokenizer.json"))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    target = spectool.load(d)
    assert target.encode("def fib(n):") == [1, 2, 3, 4, 5, 6]
    assert target.decode([1, 2]) == "def fib"
    assert target.eos_token_ids == [5, 6]
    assert target.device == torch.device("cpu") and target.dtype == torch.float32
    # Same weight files -> same hash; other weights of the same shapes -> another hash.
    assert target.model_hash == spectool.load(llama_dir).model_hash
    other = tmp_path / "other"
    save_hf_model("llama", other, seed=4)
    assert spectool.load(other).model_hash != target.model_hash


def test_no_tokenizer_is_a_clear_error(llama_dir):
    target = spectool.load(llama_dir)
    assert target.tokenizer is None
    with pytest.raises(ValueError, match="without a tokenizer"):
        target.encode("hello")
    with pytest.raises(ValueError, match="without a tokenizer"):
        target.decode([1])


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "architectures"),
    (lambda c: c.pop("num_attention_heads"), "num_attention_heads"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "yarn"),
])
def test_bad_config(llama_dir, tmp_path, edit, match):
    d = copy_checkpoint(llama_dir, tmp_path / "bad", edit_config=edit)
    with pytest.raises(ValueError, match=match):
        spectool.load(d)


def test_missing_and_misshaped_tensors(llama_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    d = copy_checkpoint(llama_dir, tmp_path / "missing", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        spectool.load(d)
    d = copy_checkpoint(llama_dir, tmp_path / "shape",
                        edit_tensors=lambda t: t.update({name: t[name][:-1].contiguous()}))
    with pytest.raises(ValueError, match=rf"{name}.*shape"):
        spectool.load(d)


def test_bad_paths_and_dtype(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        spectool.load(llama_dir, dtype=torch.int8)
    with pytest.raises(ValueError, match="is a file"):
        spectool.load(llama_dir / "config.json")
    with pytest.raises(ValueError, match="no config.json"):
        spectool.load(tmp_path)


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="could not be downloaded"):
        spectool.load("some-org/some-model-that-is-not-cached")


def test_out_of_vocab_tokens_in_forward(llama_dir):
    target = spectool.load(llama_dir)
    V = target.config.vocab_size
    with pytest.raises(ValueError, match="token ids"):
        target.model(torch.tensor([[1, V]]), torch.tensor([[0, 1]]))


def test_check_prompt():
    assert check_prompt((1, 2, 3), max_seq_len=10, max_new_tokens=7, vocab_size=4) == [1, 2, 3]
    for args, match in [(([], 10, 1), "empty"), (([1] * 5, 10, 6), "max_seq_len"),
                        (([1], 10, 0), "max_new_tokens"), (([1, 99], 10, 1), "99")]:
        with pytest.raises(ValueError, match=match):
            check_prompt(*args, vocab_size=50)
