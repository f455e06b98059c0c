"""Training: tokenizer, held-out split, target training + HF export, draft training, resume, bad input."""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import spectool as st
from spectool.cli import main
from spectool.cli.train_draft import main as train_draft_main
from spectool.cli.train_target import main as train_target_main
from spectool.model.draft_layer import load_draft
from spectool.train import data
from spectool.train.draft import DraftRecipe, train_draft
from spectool.train.loop import CHECKPOINT_NAME
from spectool.train.target import TargetRecipe, train_target
from spectool.train.tokenizer import EOS_TOKEN, eos_id, train_tokenizer

TINY = {"vocab_size": 300, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 64, "batch_size": 4, "seq_len": 32, "lr": 1e-2, "warmup": 2,
        "eval_windows": 2}
DRAFT_TINY = {"batch_size": 2, "seq_len": 24, "eval_windows": 2, "gen_prompts": 2, "gen_tokens": 8,
              "checkpoint_every": 2}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small slice of the stdlib training split as one text file."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    files = [p for p in data.stdlib_files() if 2_000 < p.stat().st_size < 20_000][:4]
    path.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in files))
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("target")
    result = train_target(corpus, out, TargetRecipe(steps=30, checkpoint_every=10, **TINY), device="cpu",
                          progress=False)
    return out, result


def test_tokenizer_round_trips_any_text():
    docs = ["def f(x):\n    return x + 1\n", "class A:\n\tpass\n"] * 20
    tok = train_tokenizer(docs, vocab_size=300)
    assert tok.get_vocab_size() <= 300
    assert tok.id_to_token(eos_id(tok)) == EOS_TOKEN
    for text in ["def f(x):\n    return x + 1\n", "λ → ünïcode never seen 😀\r\n", "  \t  trailing  ", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    # Training actually merged something: common code is shorter than its bytes.
    assert len(tok.encode(docs[0]).ids) < len(docs[0].encode())


def test_held_out_modules_never_in_training_corpus():
    root = data.stdlib_root()
    train = {p.relative_to(root).as_posix() for p in data.stdlib_files()}
    held = {p.relative_to(root).as_posix() for p in data.stdlib_files(held_out=True)}
    assert train and held and not train & held
    # Paths written out by hand (not via is_held_out): each module's source is held out, never trained on.
    for m in data.HELD_OUT_MODULES:
        src = "json/__init__.py" if m == "json" else f"{m}.py"
        assert src in held and src not in train
        assert f"test/test_{m}.py" not in train
        assert not any(p.startswith(f"test/test_{m}/") or p.startswith(f"{m}/") for p in train)
    # And no training document contains a held-out module's text.
    textwrap_src = (root / "textwrap.py").read_text()
    assert all(textwrap_src not in doc for doc in data.stdlib_documents())


def test_prompts_come_from_held_out_files():
    named = data.heldout_named_documents()
    texts = dict(named)
    for p in data.completion_prompts(named, 6, prompt_chars=600):
        assert p["kind"] == "completion" and p["prompt"] + p["reference"] in texts[p["source"]]
        assert p["prompt"].endswith("\n")
    for p in data.editing_prompts(named, 4, chunk_chars=800):
        original = p["prompt"].split("\n", 1)[1]
        edited_rest = p["reference"]
        # The continuation mostly repeats text already in the prompt (what N-gram drafting needs).
        ratio = difflib.SequenceMatcher(None, original, edited_rest, autojunk=False).find_longest_match(
            0, len(original), 0, len(edited_rest)).size
        assert ratio > 50 and p["source"] in texts


def test_target_learns_and_transformers_agrees(trained):
    out, result = trained
    history = [loss for _, loss in result["loss_history"]]
    assert history[-1] < history[0]
    assert result["heldout_loss"] < math.log(TINY["vocab_size"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").is_file()
    saved = json.loads((out / "eval.json").read_text())
    assert saved["heldout_loss"] == pytest.approx(result["heldout_loss"])

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    target = st.load(out, device="cpu", dtype=torch.float32)
    ids = torch.tensor([target.encode("def wrap(text, width=70):\n    return [line")])
    with torch.no_grad():
        ours = target.model.logits(target.model(ids, torch.arange(ids.shape[1])[None]))
        theirs = ref(ids).logits.float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,layers", [("eagle", 1), ("multi_layer_eagle", 2)])
def test_train_draft_writes_a_loadable_checkpoint(trained, corpus, tmp_path, method, layers):
    target_dir, _ = trained
    out = tmp_path / method
    result = train_draft(target_dir, corpus, out, DraftRecipe(method=method, layers=layers, steps=4, unroll=2,
                                                              eval_steps=3, **DRAFT_TINY),
                         device="cpu", progress=False)
    draft = load_draft(out, st.load(target_dir))
    assert draft.kind == method and draft.num_layers == layers
    assert draft.chained == (method == "multi_layer_eagle")  # the recipe's default wiring
    assert len(result["agreement"]) == (layers if method == "multi_layer_eagle" else 3)
    assert all(0.0 <= a <= 1.0 for a in result["agreement"])
    assert 0.0 <= result["greedy_accept_length"] <= len(result["agreement"])
    # The saved weights are the trained ones (bf16-rounded), not a fresh init.
    state = torch.load(out / CHECKPOINT_NAME, weights_only=False)["draft"]
    saved = load_file(out / "model.safetensors")
    torch.testing.assert_close(saved["layers.0.eh_proj.weight"].float(),
                               state["layers.0.eh_proj.weight"].to(torch.bfloat16).float())


def test_train_eagle3_learns_and_decodes_losslessly(trained, corpus, tmp_path):
    from collections import Counter

    from spectool.model.eagle3 import load_eagle3

    target_dir, _ = trained
    out = tmp_path / "eagle3"
    recipe = DraftRecipe(method="eagle3", steps=40, unroll=2, eval_steps=2, draft_vocab_size=120, aux_layers=(0, 1, 1),
                         lr=1e-2, warmup=2, **{**DRAFT_TINY, "checkpoint_every": 20})
    result = train_draft(target_dir, corpus, out, recipe, device="cpu", progress=False)
    target = st.load(target_dir)
    draft = load_eagle3(out, target)
    assert draft.aux_layers == (0, 1, 1)
    ids = (torch.arange(120) + draft.layer.d2t).tolist()
    assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < target.config.vocab_size
    # The draft vocabulary holds the corpus's most frequent tokens (counted here independently).
    common = Counter(target.encode(corpus.read_text(), add_special_tokens=False)).most_common(20)
    assert all(t in ids for t, _ in common)
    # This tiny target mostly repeats one token, so its entropy (the loss's floor) is high, but the
    # draft's top-1 must have moved from chance (1 in 120) to agreeing with the target's.
    losses = [loss for _, loss in result["loss_history"]]
    assert losses[-1] < losses[0]
    assert result["agreement"][0] > 0.5
    assert 0.0 < result["greedy_accept_length"] <= 2
    prompts = [target.encode(line) for line in corpus.read_text().splitlines() if len(line) > 30][:6]
    plain = st.Engine(target, max_seq_len=256).generate(prompts, max_new_tokens=12, ignore_eos=True, record=False)
    spec = st.Engine(target, draft=st.Eagle3Config(out, num_steps=3, topk=2, num_draft_tokens=6), max_seq_len=256)
    got = spec.generate(prompts, max_new_tokens=12, ignore_eos=True, record=False)
    assert got.token_ids == plain.token_ids
    assert got.stats.mean_accept_length > 0.1


def test_resume_after_interrupt_equals_uninterrupted(corpus, tmp_path, monkeypatch):
    recipe = TargetRecipe(steps=6, checkpoint_every=2, **TINY)
    train_target(corpus, tmp_path / "straight", recipe, device="cpu", progress=False)

    real = data.random_windows
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # in step 5: the checkpoint of step 4 is the last one written
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "random_windows", interrupted)
    with pytest.raises(SystemExit, match="--resume"):
        train_target(corpus, tmp_path / "resumed", recipe, device="cpu", progress=False)
    assert torch.load(tmp_path / "resumed" / CHECKPOINT_NAME, weights_only=False)["step"] == 4
    monkeypatch.setattr(data, "random_windows", real)
    result = train_target(corpus, tmp_path / "resumed", recipe, device="cpu", resume=True, progress=False)
    assert result["resumed_from"] == 4 and result["steps"] == 6
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_train_draft_cli_resumes(trained, corpus, tmp_path):
    target_dir, _ = trained
    args = ["--target", str(target_dir), "--method", "multi_layer_eagle", "--layers", "1",
            "--corpus", str(corpus), "--out", str(tmp_path / "d"), "--batch-size", "2", "--seq-len", "24",
            "--checkpoint-every", "2",
            "--device", "cpu", "--no-progress"]
    assert train_draft_main([*args, "--steps", "2"]) == 0
    assert train_draft_main([*args, "--steps", "4", "--resume"]) == 0
    result = json.loads((tmp_path / "d" / "eval.json").read_text())
    assert result["resumed_from"] == 2 and result["steps"] == 4


def test_bad_input_gives_clear_errors(trained, corpus, tmp_path, capsys):
    target_dir, _ = trained
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        data.read_corpus(empty)
    with pytest.raises(ValueError, match="does not exist"):
        data.read_corpus(tmp_path / "missing.txt")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(ValueError, match="not readable"):
        data.read_corpus(binary)
    assert train_target_main(["--corpus", str(empty), "--out", str(tmp_path / "t"), "--device", "cpu"]) == 2
    assert "holds no text" in capsys.readouterr().err

    (tmp_path / "notmodel").mkdir()
    (tmp_path / "notmodel" / "config.json").write_text("{}")
    base = ["--corpus", str(corpus), "--out", str(tmp_path / "d"), "--device", "cpu", "--no-progress"]
    assert train_draft_main(["--target", str(tmp_path / "notmodel"), "--method", "eagle", *base]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert main(["train-draft", "--target", str(target_dir), "--method", "multi_layer_eagle", "--layers", "0",
                 *base]) == 2
    assert "--layers: must be >= 1" in capsys.readouterr().err
    assert main(["train-draft", "--target", str(tmp_path / "missing"), "--method", "eagle", *base]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # bad input is refused before --out is created
    with pytest.raises(ValueError, match="--layers must be 1"):
        DraftRecipe(method="eagle", layers=2)


def test_existing_checkpoint_is_never_overwritten(trained, corpus, tmp_path):
    target_dir, _ = trained
    before = (target_dir / CHECKPOINT_NAME).read_bytes()
    with pytest.raises(ValueError, match="--resume"):
        train_target(corpus, target_dir, TargetRecipe(steps=2, **TINY), device="cpu", progress=False)
    assert (target_dir / CHECKPOINT_NAME).read_bytes() == before


def test_out_of_memory_names_a_smaller_batch(trained, corpus, tmp_path, monkeypatch):
    target_dir, _ = trained
    out = tmp_path / "oom"
    recipe = DraftRecipe(method="eagle", steps=6, **DRAFT_TINY | {"batch_size": 8})
    real = data.random_windows
    calls = {"n": 0}

    def oom_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "random_windows", oom_on_third)
    with pytest.raises(SystemExit, match="--batch-size 8; try --batch-size 4"):
        train_draft(target_dir, corpus, out, recipe, device="cpu", progress=False)
    state = torch.load(out / CHECKPOINT_NAME, weights_only=False)
    assert state["step"] == 2  # the checkpoint written before the failure is intact


def test_an_op_without_backward_is_caught():
    from spectool.train.loop import check_gradients

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[1](model[0](torch.ones(1, 2)).detach()).sum().backward()  # as a kernel without autograd would
    with pytest.raises(RuntimeError, match="0.weight"):
        check_gradients(model)
