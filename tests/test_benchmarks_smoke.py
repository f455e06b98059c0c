"""The head-to-head benchmark scripts, run in their --quick CPU mode so they cannot rot.

Each script runs in-process (benchmarks/ on sys.path, as when run from there) and its
JSON is checked against what the script promises: equal work per method, greedy
speculative output equal to plain output, speedups and implied speedups that follow
from the reported times.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(name: str, out: Path, *extra: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        module = importlib.import_module(name)
        assert module.main(["--device", "cpu", "--quick", "--out", str(out), *extra]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    return json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def speculative_json(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    return run_script("speculative", out), out


def test_speculative_equal_work_and_lossless(speculative_json):
    data, _ = speculative_json
    rows = data["rows"]
    import spectool as st

    # Every method whose draft the bundle holds (EAGLE-3 where it has the layer).
    methods = ("plain", "ngram", "eagle", "multi_layer_eagle") + (
        ("eagle3",) if (st.demo_model() / "eagle3").is_dir() else ())
    assert {(r["workload"], r["method"]) for r in rows} == {
        (w, m) for w in ("completion", "editing") for m in methods}
    for r in rows:
        assert r["generated_tokens"] == r["new_tokens"] * r["batch"]  # ignore_eos: the same work everywhere
        assert r["same_tokens_as_plain"] is True  # greedy speculative decoding is lossless (float32 on CPU)
        plain = next(p for p in rows if p["method"] == "plain" and p["workload"] == r["workload"]
                     and p["batch"] == r["batch"])
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        assert r["end_to_end_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        assert r["end_to_end_speedup"] == pytest.approx(r["end_to_end_tokens_per_s"]
                                                       / plain["end_to_end_tokens_per_s"])
        assert r["prefill_vs_plain"] == pytest.approx(r["prefill_ms"] / plain["prefill_ms"])
        assert 0 < r["time_to_first_token_ms"] < r["wall_s"] * 1e3
        assert r["refused"] is None  # the CPU runs eagerly: nothing to refuse
        assert "verify_us" in r["phase_us"]
    assert all(r["mean_accept_length"] == 0 for r in rows if r["method"] == "plain")


def test_the_headline_table_reads_the_speculative_json(speculative_json, tmp_path):
    """The JSON names its command (without --out) and benchmarks/headline.py turns it into rows."""
    import shutil

    data, out = speculative_json
    assert data["meta"]["command"] == "python3 benchmarks/speculative.py --device cpu --quick"
    assert data["meta"]["machine"] and data["meta"]["date"]
    folder, doc = tmp_path / "json", tmp_path / "BENCHMARKS.md"
    folder.mkdir()
    shutil.copy(out / "speculative.json", folder)
    shutil.copy(BENCHMARKS.parent / "docs" / "BENCHMARKS.md", doc)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        assert importlib.import_module("headline").main(["--json", str(folder), "--doc", str(doc)]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    rows = [line.split(" | ") for line in doc.read_text().splitlines()
            if line.startswith("| Speculative decoding, demo model |") and data["meta"]["date"][:10] in line]
    names = {"ngram": "N-gram", "eagle": "EAGLE", "eagle3": "EAGLE-3", "multi_layer_eagle": "multi-layer EAGLE"}
    assert {r[1] for r in rows} == {f"{names[r['method']]}, {r['workload']}, bs 1" for r in data["rows"]
                                    if r["method"] != "plain"}
    assert all(r[-1] == f"`{data['meta']['command']}` |" for r in rows)


def test_speculative_set_overrides_a_method_setting(tmp_path):
    data = run_script("speculative", tmp_path, "--methods", "eagle", "--workloads", "completion",
                      "--set", "eagle.num_draft_tokens=4", "--set", "eagle.num_steps=2")
    eagle = data["meta"]["settings"]["eagle"]
    assert (eagle["num_draft_tokens"], eagle["num_steps"], eagle["topk"]) == (4, 2, 4)
    row = next(r for r in data["rows"] if r["method"] == "eagle")
    assert row["mean_accept_length"] <= 2 and row["same_tokens_as_plain"] is True
    for bad in ("eagle.bogus=1", "eagle.topk=0", "plain.x=1", "eagle"):
        with pytest.raises(SystemExit) as exit_:
            run_script("speculative", tmp_path, "--set", bad)
        assert exit_.value.code == 2


def test_speculative_sampled_cells_and_their_implied_speedup(tmp_path):
    rows = run_script("speculative", tmp_path, "--methods", "eagle", "--workloads", "editing",
                      "--temperatures", "0,1.0")["rows"]
    assert {(r["method"], r["temperature"]) for r in rows} == {(m, t) for m in ("plain", "eagle") for t in (0, 1.0)}
    greedy = next(r for r in rows if r["method"] == "eagle" and r["temperature"] == 0)
    sampled = next(r for r in rows if r["method"] == "eagle" and r["temperature"] == 1.0)
    assert sampled["same_tokens_as_plain"] is None and sampled["generated_tokens"] == greedy["generated_tokens"]
    assert sampled["implied_speedup"] == pytest.approx(
        greedy["speedup"] * (1 + sampled["mean_accept_length"]) / (1 + greedy["mean_accept_length"]))


def test_a_cell_with_captures_or_eager_steps_in_its_timed_region_is_refused():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from speculative import refused
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert refused({"timed_graph_captures": 0, "timed_eager_steps": 0}, "cuda") is None
    assert "2 graph captures" in refused({"timed_graph_captures": 2, "timed_eager_steps": 0}, "cuda")
    assert "3 eager steps" in refused({"timed_graph_captures": 0, "timed_eager_steps": 3}, "cuda")
    assert refused({"timed_graph_captures": 0, "timed_eager_steps": 3}, "cpu") is None


def test_step_times_implied_speedup_follows_from_times(speculative_json):
    spec, out = speculative_json
    data = run_script("step_times_8b", out, "--accept-json", str(out / "speculative.json"))
    times = data["times"]
    assert set(times["verify_us"]) >= {"4", "8", "16", "64"}
    for r in data["rows"]:
        measured = [s for s in spec["rows"] if s["method"] == r["method"] and s["batch"] == 1]
        assert r["accept_length"] in [s["mean_accept_length"] for s in measured]
        draft = sum(times["draft_us"][str(t)] * c for t, c in r["draft_steps"])
        expected = (r["accept_length"] + 1) * times["decode_us"] / (times["verify_us"][str(r["N"])] + draft)
        assert r["implied_speedup"] == pytest.approx(expected)


def test_sweep_fills_both_quick_grids(tmp_path):
    grids = run_script("sweep", tmp_path)["grids"]
    for name in ("ngram", "eagle"):
        g = grids[name]
        assert len(g["x_values"]) == len(g["y_values"]) == 2
        cells = [v for key in ("mean_accept_length", "tokens_per_s") for row in g[key] for v in row]
        assert all(math.isfinite(v) and v >= 0 for v in cells)
        # accept length can never exceed the tree depth of the cell's setting
        for j, y in enumerate(g["y_values"]):
            for i, x in enumerate(g["x_values"]):
                depth = x if name == "eagle" else y - 1
                assert g["mean_accept_length"][j][i] <= depth


def test_vs_transformers_pairs(tmp_path):
    pytest.importorskip("transformers")
    rows = run_script("vs_transformers", tmp_path)["rows"]
    assert [(r["spectool_method"], r["hf_method"]) for r in rows] == [("ngram", "prompt lookup"),
                                                                      ("eagle", "assisted")]
    for r in rows:
        assert r["hf"] is not None and r["hf_plain"] is not None
        # both sides generate exactly max_new_tokens per prompt
        counts = {r[side]["generated_tokens"] for side in ("hf", "hf_plain", "spectool")}
        assert len(counts) == 1
        assert r["ratio"] == pytest.approx(r["spectool"]["tokens_per_s"] / r["hf"]["tokens_per_s"])
        assert r["hf_plain"]["mean_accept_length"] == pytest.approx(0.0)  # one forward per token


def test_accept_lengths_cover_every_method_and_workload(tmp_path):
    rows = run_script("accept_lengths", tmp_path)["rows"]
    assert {(r["workload"], r["method"]) for r in rows} == {
        (w, m) for w in ("completion", "editing") for m in ("ngram", "eagle", "multi_layer_eagle", "eagle3")}
    for r in rows:
        # a chain of 4 (multi-layer) or a tree of depth 5 (EAGLE, EAGLE-3) or 11 (N-gram) bounds the mean
        depth = {"ngram": 11, "eagle": 5, "multi_layer_eagle": 4, "eagle3": 5}[r["method"]]
        assert 0 <= r["per_prompt_min"] <= r["per_prompt_mean"] <= r["per_prompt_max"] <= depth
        assert r["per_prompt_min"] <= r["mean_accept_length"] <= r["per_prompt_max"]


def test_accept_lengths_takes_a_method_subset_and_refuses_unknown_ones(tmp_path, capsys):
    rows = run_script("accept_lengths", tmp_path, "--methods", "eagle3")["rows"]
    assert [(r["workload"], r["method"]) for r in rows] == [("completion", "eagle3"), ("editing", "eagle3")]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        module = importlib.import_module("accept_lengths")
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--device", "cpu", "--quick", "--methods", "eagle,eagle4"])
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert exit_info.value.code == 2
    assert "unknown method(s) eagle4" in capsys.readouterr().err


def test_draft_model_benchmark_with_the_target_as_its_own_draft(tmp_path):
    import spectool as st

    data = run_script("draft_model", tmp_path, "--draft", str(st.demo_model() / "target"))
    rows = data["rows"]
    assert {(r["workload"], r["setting"]) for r in rows} == {
        (w, s) for w in ("completion", "editing") for s in ("plain", "chain4", "tree3x2")}
    for r in rows:
        plain = next(p for p in rows if p["setting"] == "plain" and p["workload"] == r["workload"])
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        if r["setting"] == "chain4":  # its own weights draft what greedy decoding produces
            assert r["mean_accept_length"] > 2


def test_trace_scale_writes_a_consistent_trace_and_times_it(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        module = importlib.import_module("trace_scale")
        assert module.main(["--records", "3000", "--batch", "16", "--out", str(tmp_path),
                            "--keep", str(tmp_path / "t.sptrace")]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    data = json.loads((tmp_path / "trace_scale.json").read_text())
    assert data["records"] == 3008 and data["cli_check_rc"] == 0  # whole iterations of 16; the checker agrees
    assert 0 < data["bytes_per_record"] < 1500 and 0 < data["mean_accept_length"] < 15
    assert data["indexed_from"] == "trailer"  # the recorder closed the file with its index
    assert data["cli_summary_rc"] == data["cli_export_perfetto_rc"] == data["cli_report_rc"] == 0


@pytest.mark.slow
def test_decode_and_speculative_split_over_two_processes(tmp_path):
    data = run_script("decode", tmp_path, "--shapes", "tiny", "--batches", "1", "--tp", "2")
    by_tp = {r["tp"]: r for r in data["rows"]}
    assert set(by_tp) == {1, 2}  # the split run, then the whole target in the same call
    # The TP 2 floor: each rank reads about half the weights (norms are replicated) at its bandwidth.
    assert 1.8 < by_tp[1]["weight_gb"] / by_tp[2]["weight_gb"] <= 2.0
    assert by_tp[2]["floor_tok_s"] == pytest.approx(by_tp[2]["copy_tb_s"] * 1e3 / by_tp[2]["weight_gb"])
    assert by_tp[2]["vs_tp1"] == pytest.approx(by_tp[2]["spectool_graphs_tok_s"] / by_tp[1]["spectool_graphs_tok_s"])
    data = run_script("speculative", tmp_path, "--tp", "2", "--methods", "ngram,eagle", "--workloads", "completion")
    for r in data["rows"]:
        assert r["tp"] == 2 and r["pct_floor"] == pytest.approx(100 * r["tokens_per_s"] / r["floor_tok_s"])
        assert r["method"] == "plain" or r["same_tokens_as_plain"] is True
