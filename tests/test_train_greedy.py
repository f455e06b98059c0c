"""Draft training on the target's own greedy continuations (``DraftRecipe.greedy_fraction``).

Oracles: ``data.random_windows`` with the same generator (what every batch was before the
option), and plain greedy decoding with a full, uncached forward per token on the bundled demo
target (independent of the KV-cache decode that generates the training rows).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import spectool as st
from spectool.cli import main
from spectool.train import data
from spectool.train.draft import DraftBatches, DraftRecipe, train_draft

SMALL = {"method": "multi_layer_eagle", "layers": 2, "batch_size": 4, "seq_len": 20, "gen_tokens": 8}


@pytest.fixture(scope="module")
def target():
    return st.load(st.demo_model() / "target", device="cpu", dtype=torch.float32)


def some_source(files: int) -> str:
    """Source of a few training-split stdlib modules."""
    names = ["dataclasses.py", "argparse.py", "functools.py"][:files]
    return "\n\n".join((data.stdlib_root() / n).read_text(encoding="utf-8") for n in names)


@pytest.fixture(scope="module")
def stream(target) -> torch.Tensor:
    return torch.tensor(target.encode(some_source(2)[:6000]))


def plain_greedy(target, prefix: list[int], new: int) -> list[int]:
    ids = list(prefix)
    with torch.no_grad():
        for _ in range(new):
            hidden = target.model(torch.tensor([ids]), torch.arange(len(ids))[None])
            ids.append(int(target.model.logits(hidden[:, -1]).argmax(-1)))
    return ids


def occurs_in(stream: torch.Tensor, window: torch.Tensor) -> bool:
    return bool((stream.unfold(0, len(window), 1) == window).all(-1).any())


def test_fraction_zero_gives_the_plain_corpus_batches(target, stream):
    recipe = DraftRecipe(**SMALL)
    batches = DraftBatches(target, stream, recipe, torch.Generator().manual_seed(3))
    ref = torch.Generator().manual_seed(3)
    for step in range(4):
        torch.testing.assert_close(batches(step), data.random_windows(stream, 4, 20, ref), atol=0, rtol=0)


def test_greedy_rows_are_a_corpus_prefix_then_the_targets_greedy_continuation(target, stream):
    recipe = DraftRecipe(**SMALL, greedy_fraction=0.5, greedy_refresh=2)
    assert recipe.greedy_rows == 2
    batches = DraftBatches(target, stream, recipe, torch.Generator().manual_seed(3))
    ref = torch.Generator().manual_seed(3)
    seen = []
    for step in range(3):  # crosses a refresh (steps 0-1 share one generation, step 2 starts the next)
        batch = batches(step)
        assert batch.shape == (4, 20) and batch.dtype == torch.long
        # The other rows are the corpus windows the run would draw anyway, one per remaining row.
        torch.testing.assert_close(batch[2:], data.random_windows(stream, 2, 20, ref), atol=0, rtol=0)
        for row in batch[:2]:
            prefix = row[:10]
            assert occurs_in(stream, prefix)
            assert row.tolist() == plain_greedy(target, prefix.tolist(), 10)
            seen.append(row)
    assert len({tuple(r.tolist()) for r in seen}) == len(seen), "greedy rows must not repeat"


def test_greedy_batches_are_seeded_and_resume_mid_refresh(target, stream):
    recipe = DraftRecipe(**SMALL, greedy_fraction=0.5, greedy_refresh=2, seed=7)
    gen = torch.Generator().manual_seed(1)
    straight = DraftBatches(target, stream, recipe, gen)
    got, states = [], []
    for step in range(4):
        got.append(straight(step))
        states.append(gen.get_state())
    # A resumed run restores the generator saved after step 2 and continues at step 3 (mid-refresh).
    resumed_gen = torch.Generator()
    resumed_gen.set_state(states[2])
    resumed = DraftBatches(target, stream, recipe, resumed_gen)
    torch.testing.assert_close(resumed(3), got[3], atol=0, rtol=0)
    # Another seed gives other greedy rows.
    other = DraftBatches(target, stream, DraftRecipe(**SMALL, greedy_fraction=0.5, greedy_refresh=2, seed=8),
                         torch.Generator().manual_seed(1))
    assert not torch.equal(other(0)[:2], got[0][:2])


def test_all_rows_greedy(target, stream):
    recipe = DraftRecipe(**SMALL, greedy_fraction=1.0, greedy_refresh=1)
    batch = DraftBatches(target, stream, recipe, torch.Generator().manual_seed(0))(0)
    assert batch.shape == (4, 20)
    for row in batch:
        assert row.tolist() == plain_greedy(target, row[:10].tolist(), 10)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_bad_greedy_fraction_is_a_clear_error(bad, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"greedy_fraction must be in \[0, 1\]"):
        DraftRecipe(**SMALL, greedy_fraction=bad)
    # The command refuses it while parsing its options, before any model loads or --out exists.
    assert main(["train-draft", "--target", str(st.demo_model() / "target"), "--method", "eagle", "--corpus",
                 "stdlib", "--out", str(tmp_path / "d"), "--greedy-fraction", str(bad)]) == 2
    assert "--greedy-fraction" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_eagle_trains_on_greedy_rows(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(some_source(3))
    recipe = DraftRecipe(method="eagle", steps=2, batch_size=2, seq_len=24, unroll=2, eval_steps=2, eval_windows=2,
                         gen_prompts=2, gen_tokens=8, greedy_fraction=0.5)
    result = train_draft(st.demo_model() / "target", corpus, tmp_path / "eagle", recipe, device="cpu",
                         progress=False)
    assert result["recipe"]["greedy_fraction"] == 0.5 and result["steps"] == 2


def test_train_draft_cli_passes_greedy_fraction(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(some_source(3))
    out = tmp_path / "mle"
    assert main(["train-draft", "--target", str(st.demo_model() / "target"), "--method", "multi_layer_eagle",
                 "--layers", "2", "--corpus", str(corpus), "--out", str(out), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "24", "--greedy-fraction", "0.5",
                 "--device", "cpu", "--no-progress"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["recipe"]["greedy_fraction"] == 0.5 and result["steps"] == 2
