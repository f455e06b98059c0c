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


@pytest.fixture(name="bench")
def ngram_vs_sglang_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # for its own imports at run time too
    return importlib.import_module("ngram_vs_sglang")


def fake_sglang_tree(bench, root: Path, leave_out: str = "", broken_unit: str = "") -> Path:
    """The file layout of SGLang's n-gram corpus sources, every file empty but ``broken_unit``
    (which includes a header nobody has) and without ``leave_out``."""
    csrc = root / "sglang/kernels/jit/csrc/ngram_corpus"
    include = root / "sglang/kernels/jit/include/sgl_kernel"
    csrc.mkdir(parents=True)
    include.mkdir(parents=True)
    for name in bench.NEEDED:
        (csrc / name).write_text('#include "no_such_header.h"\n' if name == broken_unit else "")
    for name in ("ffi.h", "tensor.h"):
        (include / name).write_text("")
    if leave_out:
        (csrc / leave_out).unlink()
    return root


def test_ngram_vs_sglang_refuses_incomplete_sources_naming_what_is_missing(tmp_path, capsys, bench):
    src = fake_sglang_tree(bench, tmp_path / "tree", leave_out="queue.h")
    assert bench.main(["--sglang-src", str(src)]) == 2
    assert "missing queue.h" in capsys.readouterr().err
    assert bench.main(["--sglang-src", str(tmp_path / "nowhere")]) == 2
    assert "no sglang/kernels/jit/csrc/ngram_corpus/" in capsys.readouterr().err
    (tmp_path / "not.whl").write_text("not a zip")
    assert bench.main(["--sglang-wheel", str(tmp_path / "not.whl")]) == 2
    assert "not a wheel" in capsys.readouterr().err


def test_ngram_vs_sglang_without_tvm_ffi_says_what_to_install(tmp_path, capsys, monkeypatch, bench):
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # as if it were not installed
    assert bench.main(["--sglang-src", str(fake_sglang_tree(bench, tmp_path))]) == 2
    assert "pip install 'apache-tvm-ffi'" in capsys.readouterr().err


def test_ngram_vs_sglang_reports_the_compilers_error(tmp_path, capsys, bench):
    pytest.importorskip("tvm_ffi", reason="the build needs apache-tvm-ffi's headers (pip install apache-tvm-ffi)")
    assert bench.main(["--sglang-src", str(fake_sglang_tree(bench, tmp_path, broken_unit="result.cpp"))]) == 2
    err = capsys.readouterr().err
    assert "the compiler failed" in err and "no_such_header.h" in err and "result.cpp" in err


def test_ngram_vs_sglang_accept_length_follows_the_tree(bench):
    """The accept length the comparison reports, from the mask alone, against a walk down the
    tree's parent links that takes the child drafting the next token of the text."""
    import numpy as np

    from spectool.native import NgramCorpus

    rng = np.random.default_rng(0)
    phrases = rng.integers(0, 50, (12, 8))  # text of a few recurring phrases: deep and branching trees
    text = phrases[rng.integers(0, 12, 500)].reshape(-1).astype(np.int32)
    corpus = NgramCorpus(max_trie_depth=bench.DEPTH, num_draft_tokens=bench.N)
    corpus.batch_put([text[:3000]])
    corpus.synchronize()
    at = np.arange(3000, 3200)
    tails = [text[p - bench.WINDOW:p] for p in at]
    conts = np.stack([text[p:p + bench.N - 1] for p in at])
    got = corpus.batch_get(None, tails, None)

    def deepest(tokens, parents, cont, node: int, depth: int) -> int:
        children = [k for k in range(len(tokens)) if parents[k] == node and depth < len(cont)
                    and tokens[k] == cont[depth]]
        return max([deepest(tokens, parents, cont, k, depth + 1) for k in children], default=depth)

    expected = [deepest(t, p, c, 0, 0) + 1 for t, p, c in zip(got.tokens, got.parents, conts)]
    assert bench.accept_lengths(got.tokens, got.mask, conts).tolist() == expected
    assert max(expected) > 2  # the walk went deep somewhere


def test_ngram_vs_sglang_with_a_wheel(tmp_path, bench):
    """The whole comparison on a few tokens, with the wheel that SPECTOOL_SGLANG_WHEEL names (read
    from disk: nothing is downloaded); SPECTOOL_SGLANG_BUILD_DIR keeps the build between runs."""
    import os

    wheel = os.environ.get("SPECTOOL_SGLANG_WHEEL")
    if not wheel:
        pytest.skip("not run: set SPECTOOL_SGLANG_WHEEL to an SGLang wheel (pip download sglang==0.5.23 --no-deps "
                    "-d DIR) to compare against its n-gram corpus")
    pytest.importorskip("tvm_ffi", reason="SGLang's corpus loads through apache-tvm-ffi (pip install apache-tvm-ffi)")
    build_dir = os.environ.get("SPECTOOL_SGLANG_BUILD_DIR", str(tmp_path / "build"))
    assert bench.main(["--sglang-wheel", wheel, "--build-dir", build_dir, "--tokens", "50000", "--iters", "5",
                       "--repeats", "1", "--capacity", "300000", "--positions", "128", "--decode-tokens", "100",
                       "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ngram_vs_sglang.json").read_text())
    assert set(data["matches"]) == {"bfs", "prob"}
    for run in data["matches"].values():
        assert [r["bs"] for r in run["rows"]] == [1, 8, 64]
        for r in run["rows"]:
            for side in ("spectool", "sglang"):
                assert r[side]["total_us"] == pytest.approx(r[side]["get_us"] + r[side]["put_us"])  # one repeat
            assert r["ratio"] == pytest.approx(r["sglang"]["total_us"] / r["spectool"]["total_us"])
            assert 0 < r["sglang"]["get_ffi_us"] <= r["sglang"]["get_us"]  # the C++ call is part of the get
        assert 0 <= run["drafts"]["same_tree"] <= 1
        for kind in ("spectool", "sglang"):  # both draft from the same text: some drafts are accepted
            assert 1 < run["drafts"]["accept"][kind] <= bench.N
            assert 1 < run["decode"][kind]["accept"] <= bench.N
    memory = data["memory"]
    for kind in ("spectool", "sglang"):
        assert memory[kind]["full_bytes"] >= memory[kind]["empty_bytes"] >= 0
        assert memory[kind]["bytes_per_node"] == pytest.approx(memory[kind]["full_bytes"] / memory["nodes"])
    assert data["meta"]["command"].startswith("python3 benchmarks/ngram_vs_sglang.py --sglang-wheel")


def test_sampling_table_tells_rounding_from_another_decision():
    # benchmarks/tree_kernels.py labels a chunked verify's cell against the torch verify: the same
    # decision, a bonus token moved across a boundary that the two float32 CDFs place within
    # rounding of each other, or another decision.
    import dataclasses

    import torch
    from test_verify import random_batch

    from spectool.verify import verify_sampling

    sys.path.insert(0, str(BENCHMARKS))
    try:
        decision_match = importlib.import_module("tree_kernels").decision_match
    finally:
        sys.path.remove(str(BENCHMARKS))
    tree, g = random_batch(3, 6, 50, 0)
    want = verify_sampling(tree, torch.randn(3, 6, 50, generator=g), 1.0, coins=torch.rand(3, 6, generator=g))
    assert decision_match(dataclasses.replace(want), want) == "True"

    def moved(start: float, mass: float, step: int = -1):
        cdf = want.bonus_cdf.clone()
        cdf[1] = torch.tensor([start, mass])
        bonus = want.bonus.clone()
        bonus[1] += step
        return dataclasses.replace(want, bonus=bonus, bonus_cdf=cdf)

    before = want.bonus_cdf[1, 0].item()
    assert decision_match(moved(before - 0.01, 0.01 + 3e-8), want) == "rounding"  # ends 3e-8 past the other's start
    assert decision_match(moved(before - 0.3, 0.01), want) == "False"  # 0.29 of mass between them
    after = before + want.bonus_cdf[1, 1].item()
    assert decision_match(moved(after - 2e-8, 0.05, step=1), want) == "rounding"
    status = want.status.clone()
    status[0, 1] = 3 - status[0, 1]
    assert decision_match(dataclasses.replace(want, status=status), want) == "False"


def test_sampling_cells_are_chosen_by_name_and_bad_names_refused(capsys):
    # benchmarks/tree_kernels.py --sampling-cuts / --sampling-dtypes, and its profile's --cuts: a GPU
    # call can time only the cells it needs; a misspelt one is a usage error before any GPU work.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        tree_kernels = importlib.import_module("tree_kernels")
        assert tree_kernels.sampling_cuts("top-p,temperature") == [(0, 0.9), (0, 1.0)]
        assert [tree_kernels.cuts_label(*c) for c in tree_kernels.sampling_cuts("top-k,top-k-top-p")] == [
            "top-k 50", "top-k 50, top-p 0.9"]
        for argv in (["--sampling-only", "--sampling-cuts", "top-q"], ["--sampling-only", "--sampling-dtypes", "int8"],
                     ["--profile", "sampling", "--cuts", "top-p,nucleus"]):
            with pytest.raises(SystemExit) as stop:
                tree_kernels.main(argv)
            assert stop.value.code == 2, argv
        err = capsys.readouterr().err
        assert "top-q" in err and "int8" in err and "nucleus" in err
    finally:
        sys.path.remove(str(BENCHMARKS))
