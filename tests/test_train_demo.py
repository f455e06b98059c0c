"""benchmarks/train_demo.py --tiny: the demo-model pipeline end to end, in the layout the engine loads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import spectool as st
from spectool.model.draft_layer import load_draft
from spectool.prompts import load_prompts

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_demo.py"


def test_tiny_demo_pipeline_writes_the_bundle_layout(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    train_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_demo)
    out = tmp_path / "demo"
    assert train_demo.main(["--out", str(out), "--tiny", "--device", "cpu"]) == 0

    target = st.load(out / "target")
    assert target.tokenizer is not None
    for kind, layers in (("eagle", 1), ("multi_layer_eagle", 4)):
        draft = load_draft(out / kind, target)
        assert draft.kind == kind and draft.num_layers == layers
    for kind in ("completion", "editing"):
        assert load_prompts(out / "prompts.jsonl", kind)
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["multi_layer_eagle"]["agreement"]) == 4
    assert metrics["weight_bytes"] == sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    assert not list(out.rglob("train_state.pt"))  # training state is not part of the bundle
    # A second run refuses to overwrite a non-empty directory.
    assert train_demo.main(["--out", str(out), "--tiny", "--device", "cpu"]) == 2

    # --from retrains only the named drafts against the bundle's target; the rest is copied.
    again = tmp_path / "again"
    assert train_demo.main(["--out", str(again), "--tiny", "--device", "cpu", "--from", str(out),
                            "--methods", "multi_layer_eagle", "--seed", "1"]) == 0
    for name in ("target/model.safetensors", "target/tokenizer.json", "eagle/model.safetensors"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    assert (again / "multi_layer_eagle/model.safetensors").read_bytes() != \
        (out / "multi_layer_eagle/model.safetensors").read_bytes()
    assert load_draft(again / "multi_layer_eagle", st.load(again / "target")).chained
    redone = json.loads((again / "metrics.json").read_text())
    assert redone["target"] == metrics["target"] | {"reused_from": str(out)}
    assert redone["eagle"] == metrics["eagle"]
    # An EAGLE-3 layer added to a bundle: it loads as the engine loads it, beside the copied drafts.
    plus = tmp_path / "plus"
    assert train_demo.main(["--out", str(plus), "--tiny", "--device", "cpu", "--from", str(again),
                            "--methods", "eagle3"]) == 0
    from spectool.model.eagle3 import load_eagle3

    assert load_eagle3(plus / "eagle3", st.load(plus / "target")).aux_layers == (0, 1, 1)
    added = json.loads((plus / "metrics.json").read_text())
    assert added["multi_layer_eagle"] == redone["multi_layer_eagle"] and len(added["eagle3"]["agreement"]) >= 1
    for bad in (["--from", str(tmp_path / "nothing")], ["--methods", "medusa"]):
        assert train_demo.main(["--out", str(tmp_path / "bad"), "--tiny", "--device", "cpu", *bad]) == 2


def test_explicit_step_counts_replace_the_epoch_derived_ones(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    train_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_demo)
    recipes = train_demo.recipes(False, 0)
    assert all(r.epochs > 0 for r in recipes)  # the full recipe counts its steps in epochs
    target, eagle, mle = train_demo.with_steps(*recipes, 7, 3)
    # epoch_steps(0, ...) is 0, so training falls back to ``steps``
    assert (target.steps, target.epochs, eagle.steps, eagle.epochs, mle.steps, mle.epochs) == (7, 0, 3, 0, 3, 0)
    assert mle.chained and mle.layers == 4  # nothing else changes
    assert train_demo.with_steps(*recipes, None, None) == recipes
