"""The tuner's benchmark scripts in their --quick CPU mode, so they cannot rot; their JSON is
checked against what each promises (every configuration predicted; profiles that load)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from spectool.tune import CostProfile

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _main(name: str, argv: list[str]) -> int:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name).main(argv)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_tune_speed_quick(tmp_path):
    assert _main("tune_speed", ["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "tune_speed.json").read_text())
    assert [r["configs"] for r in data["rows"]] == [10, 4, 4]
    assert len(data["panel_slider_ms"]) == 8


def test_tune_profiles_quick(tmp_path):
    assert _main("tune_profiles", ["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    demo = CostProfile.load(tmp_path / "demo-cpu.json")
    assert demo.has_method("eagle") and demo.has_method("multi_layer_eagle") and demo.has_method("ngram")
    shape = CostProfile.load(tmp_path / "tiny-shape-cpu.json")
    assert shape.model["hash"] is None and shape.model["shape"]["hidden_size"] == 128
