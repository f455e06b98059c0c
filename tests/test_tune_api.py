"""The tuner's edges: what it refuses (one line each), its profile, its command, its panel.

Predictions are checked against the tuner's own oracle elsewhere (test_tune_oracle.py);
here the panel's figures are checked against ``spectool.tune`` and a direct engine run,
and the profile's predicted tokens/s against the sum of its own measured parts (at a grid point: the
engine's measured iteration).
"""

from __future__ import annotations

import html
import json
import types

import numpy as np
import pyarrow as pa
import pytest

import spectool as st
from spectool.cli import main as cli_main
from spectool.trace.reader import Trace
from spectool.tune import CostProfile, TuneError
from spectool.tune import calibrate as calibration
from spectool.tune.calibrate import calibrate, time_iterations
from spectool.tune.cost_profile import shipped_profiles
from spectool.tune.profile_check import check_profile
from spectool.tune.recommend import tune

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    lines = [json.loads(x) for x in (demo_model_dir / "prompts.jsonl").read_text().splitlines() if x.strip()]
    return [target.encode(x["prompt"])[-32:] for x in lines if x["kind"] == "editing"][:2]


@pytest.fixture(scope="module")
def ngram_trace(target, prompts):
    return st.Engine(target, draft=st.NgramConfig(), max_batch_size=2, max_seq_len=128).generate(
        prompts, max_new_tokens=MAX_NEW).trace


@pytest.fixture(scope="module")
def profile(target, demo_model_dir):
    return calibrate(target, eagle_path=demo_model_dir / "eagle", batch_sizes=(1, 2), num_nodes=(1, 4, 12),
                     topks=(1, 4), eagle_steps=(1, 3), context=32, repeats=2, progress=False)


def _with_requests(trace: Trace, rows: list[dict]) -> Trace:
    return Trace(trace.steps, pa.Table.from_pylist(rows, schema=trace.requests.schema), trace.run_info,
                 trace.tokenizer_json)


def test_refusals_are_one_line(target, prompts, ngram_trace, profile, demo_model_dir, tmp_path):
    sampled = st.Engine(target, draft=st.NgramConfig(), max_batch_size=2, max_seq_len=128).generate(
        prompts, max_new_tokens=4, temperature=0.8).trace
    rows = ngram_trace.requests.to_pylist()
    cases = {
        "sampled": (lambda: tune(sampled, progress=False)),
        "no request rows": (lambda: tune(_with_requests(ngram_trace, []), progress=False)),
        "aborted": (lambda: tune(_with_requests(ngram_trace, [{**rows[0], "finish_reason": "aborted"}, rows[1]]),
                                 progress=False)),
        "is not a directory": (lambda: tune(ngram_trace, method="eagle", draft_path=tmp_path / "missing",
                                            target=target, progress=False)),
        "draft checkpoint": (lambda: tune(ngram_trace, grid=[st.EagleConfig(tmp_path / "gone")], target=target,
                                          progress=False)),
        "needs the target": (lambda: tune(ngram_trace, method="eagle", draft_path=demo_model_dir / "eagle",
                                          progress=False)),
        "not a ngram setting": (lambda: tune(ngram_trace, grid={"topk": [1]}, progress=False)),
    }
    other = CostProfile(json.loads(json.dumps(profile.data)), "other.json")
    other.data["model"]["hash"] = "0" * 40
    cases["measured for model"] = lambda: tune(ngram_trace, profile=other, progress=False)
    (tmp_path / "bad.json").write_text("{}")
    cases["not a spectool cost profile"] = lambda: tune(ngram_trace, profile=tmp_path / "bad.json", progress=False)
    for needle, call in cases.items():
        with pytest.raises(TuneError) as err:
            call()
        assert needle in str(err.value) and "\n" not in str(err.value), needle
    # ... and the profile of another model of the same shape is accepted when asked for.
    assert tune(ngram_trace, grid=[st.NgramConfig()], profile=other, allow_other_model=True,
                progress=False).predictions


def test_profile_prediction_is_the_sum_of_its_measured_parts(ngram_trace, profile, demo_model_dir):
    config = st.NgramConfig(num_draft_tokens=4)
    result = tune(ngram_trace, grid=[config], profile=profile, progress=False)
    pred = result.predictions[0]
    total = sum(profile.plain_us(b) + profile.verify_us(b, n) - profile.verify_us(b, 1) + profile.draft_us(config, b, n)
                for b, n in zip(pred.batch_size.tolist(), pred.num_nodes.tolist()))
    gained = int(pred.accept_length.sum()) + pred.accept_length.size
    assert result.tokens_per_s(pred) == pytest.approx(gained / total * 1e6)
    assert set(pred.num_nodes.tolist()) <= {1, 4} and pred.batch_size.max() <= 2
    v = profile.data["verify_us"]
    assert profile.verify_us(1, 4) == pytest.approx(v["us"][0][v["num_nodes"].index(4)])  # a grid point's own
    # ... and at a draft grid point the predicted iteration is the engine's measured one, whatever the verify
    # step timed alone says: N-gram by (B, N), EAGLE by (B, top-k, steps) at the tree size it ran with.
    ngram = profile.data["draft_us"]["ngram"]
    assert ngram["num_nodes"] == [2, 4, 12]  # N 2 unasked: the roots-alone iterations' draft share
    assert profile.iteration_us(st.NgramConfig(num_draft_tokens=12), 2, 12) == pytest.approx(
        ngram["iteration_us"][1][2])
    eagle = profile.data["draft_us"]["eagle"]
    k, s, n = eagle["topk"][1], eagle["num_steps"][1], eagle["num_nodes"][1][1]
    eagle_config = st.EagleConfig(demo_model_dir / "eagle", num_steps=s, topk=k, num_draft_tokens=n)
    assert profile.iteration_us(eagle_config, 1, n) == pytest.approx(eagle["iteration_us"][0][1][1])
    assert profile.iteration_us(None, 2, 1) == pytest.approx(profile.data["plain_us"]["us"][1])
    row = result.frame.iloc[0]
    assert row["speedup"] == pytest.approx(result.tokens_per_s(pred) / result.tokens_per_s(result.plain))


def test_one_configuration_timed_again_the_calibrations_way(target, demo_model_dir):
    # What tune_accuracy --recheck reads: the engine's own iteration times, one figure per config.
    for draft in (None, st.NgramConfig(num_draft_tokens=4), st.EagleConfig(demo_model_dir / "eagle", num_steps=2,
                                                                          topk=1, num_draft_tokens=3)):
        us = time_iterations(target, draft, 2, context=32, iterations=2)
        assert 0 < us < float("inf"), draft
    with pytest.raises(ValueError, match="max_batch_size"):
        time_iterations(target, None, 0, context=32)


def test_every_engine_point_is_the_median_of_interleaved_passes(target, demo_model_dir, monkeypatch):
    # The host's speed moves over a calibration's minutes: each engine point is timed once per pass over
    # the whole grid (not its passes back to back) and keeps the median of its passes.
    calls = []
    fake = {}  # (config, batch) -> this point's run means, in order

    def one_run(self, engine, new_tokens, batch_size, full_trees):
        key = (repr(engine.draft_config), batch_size)
        calls.append((key, full_trees))
        return fake[key].pop(0)

    configs = [None, st.NgramConfig(num_draft_tokens=4),
               st.MultiLayerEagleConfig(demo_model_dir / "multi_layer_eagle", num_steps=1)]
    runs = calibration._Runs(target, 32, 2, 2)
    for i, c in enumerate(configs):
        for b in (1, 2):
            fake[(repr(c), b)] = [100.0 * i + 10 * b + d for d in (3, 1, 2)]  # median: the pass with + 2
    expected = [[100.0 * i + 10 * b + 2 for b in (1, 2)] for i in range(len(configs))]
    monkeypatch.setattr(calibration._Runs, "run_mean_us", one_run)
    assert calibration.PASSES == 3
    assert calibration._interleaved(runs, configs, [1, 2], progress=False) == expected
    points = [(repr(c), b) for c in configs for b in (1, 2)]
    assert [k for k, _ in calls] == points * calibration.PASSES  # pass after pass over the whole grid
    assert [f for _, f in calls] == [isinstance(c, st.NgramConfig) for c in configs for b in (1, 2)] * 3
    fake[(repr(None), 1)] = [900.0, 300.0, 500.0]
    assert runs.point_us(types.SimpleNamespace(draft_config=None), 8, 1) == 500.0


def test_a_calibration_run_keeps_the_mean_of_its_timed_iterations(target, monkeypatch):
    # A workload's tokens/s is its tokens over the sum of its iterations: what a run keeps is the mean
    # of the iterations it times (after the warm ones), which a few slow iterations move and a median
    # would not.
    from spectool.stats import RunStats

    add = RunStats.add_iteration

    def timed(self, iteration, request_ids, accept_lengths, tree_depths, phase_us):
        add(self, iteration, request_ids, accept_lengths, tree_depths,
            {**phase_us, "iteration_us": 1000.0 if iteration % 4 == 0 else 100.0})

    monkeypatch.setattr(RunStats, "add_iteration", timed)
    runs = calibration._Runs(target, 32, 8, 1)
    engine, new_tokens = runs.engine(None)
    first = calibration.WARM_ITERATIONS  # the engine counts iterations from 0
    times = [1000.0 if k % 4 == 0 else 100.0 for k in range(first, first + 8)]
    assert runs.run_mean_us(engine, new_tokens, 1, full_trees=False) == pytest.approx(sum(times) / len(times))


def test_every_ngram_calibration_run_drafts_from_the_same_corpus(target, monkeypatch):
    # The trie outlives a run: a pass after the first must not draft from what earlier runs put.
    from spectool.draft.ngram import NgramDrafter

    trees: list[list] = []
    draft = NgramDrafter.draft

    def spy(self, batch, timer):
        tree, extra = draft(self, batch, timer)
        trees[-1].append((tree.tokens.tolist(), tree.valid.tolist()))
        return tree, extra

    monkeypatch.setattr(NgramDrafter, "draft", spy)
    runs = calibration._Runs(target, 48, 6, 2)
    engine, new_tokens = runs.engine(st.NgramConfig(num_draft_tokens=4))
    for _ in range(3):
        trees.append([])
        runs.run_mean_us(engine, new_tokens, 2, full_trees=True)
    assert trees[0] and any(any(v[1:]) for _, valid in trees[0] for v in valid)  # trees were drafted
    assert trees[1] == trees[0] and trees[2] == trees[0]


def _retimed(trace: Trace, us_of) -> Trace:
    """``trace`` with every iteration's iteration_us set to us_of(batch size, tree size) of that iteration."""
    frame = trace.steps.select(["iteration", "num_nodes"]).to_pandas()
    batch = frame.groupby("iteration")["iteration"].transform("size")
    us = [us_of(int(b), int(n)) for b, n in zip(batch, frame["num_nodes"])]
    steps = trace.steps.set_column(trace.steps.schema.get_field_index("iteration_us"), "iteration_us",
                                   pa.array(us, pa.float32()))
    return Trace(steps, trace.requests, trace.run_info, trace.tokenizer_json)


def test_the_profile_is_checked_against_the_recorded_runs_own_iterations(ngram_trace, profile, tmp_path, target):
    # A trace whose every iteration took 1.25 times what the profile predicts for the recorded configuration
    # (N-gram, N 12, batch 1 and 2, drafted and roots-alone iterations): the profile's iterations read 20 % fast.
    recorded = st.NgramConfig(**{k: v for k, v in ngram_trace.run_info["draft"].items() if k != "method"})
    assert ngram_trace.run_info["device_name"] == "cpu" and profile.device == "cpu"
    slow = _retimed(ngram_trace, lambda b, n: 1.25 * profile.iteration_us(recorded, b, n))
    assert set(slow.steps["num_nodes"].to_pylist()) == {1, 12} and slow.steps.num_rows > len(set(
        slow.steps["iteration"].to_pylist()))  # both kinds of iteration, and iterations of two rows
    result = tune(slow, grid=[st.NgramConfig(num_draft_tokens=4)], profile=profile, progress=False)
    check = result.profile_check
    assert check.iterations == len(set(slow.steps["iteration"].to_pylist())) and check.method == "ngram"
    assert check.ratio == pytest.approx(0.8, rel=1e-6) and check.error == pytest.approx(-0.2, rel=1e-5)
    assert "-20.0%" in check.describe() and "+25%" in check.describe() and check.describe() in result.report()
    # Graph captures in a run's first iterations do not move it: the figure is a median over iterations.
    first = int(slow.steps["iteration"][0].as_py())
    outlier = _retimed(slow, lambda b, n: 1.25 * profile.iteration_us(recorded, b, n))
    us = outlier.steps["iteration_us"].to_numpy().copy()
    us[np.asarray(outlier.steps["iteration"].to_numpy()) == first] = 1e9
    outlier = Trace(outlier.steps.set_column(outlier.steps.schema.get_field_index("iteration_us"), "iteration_us",
                                             pa.array(us, pa.float32())), outlier.requests, outlier.run_info,
                    outlier.tokenizer_json)
    assert tune(outlier, grid=[st.NgramConfig(num_draft_tokens=4)], profile=profile,
                progress=False).profile_check.ratio == pytest.approx(0.8, rel=1e-6)
    # A plain-decoding trace is checked against plain decoding's iterations.
    plain = st.Engine(target, draft=None, max_batch_size=2, max_seq_len=128).generate(
        ngram_trace.requests["prompt_tokens"].to_pylist(), max_new_tokens=MAX_NEW).trace
    check = check_profile(_retimed(plain, lambda b, n: 0.5 * profile.plain_us(b)), profile)
    assert check.method == "none" and check.ratio == pytest.approx(2.0, rel=1e-6)
    # Another device, or a method the profile has no timings for: no figure, and the reason in one line.
    gpu = Trace(slow.steps, slow.requests, {**slow.run_info, "device": "cuda:0", "device_name": "NVIDIA H200"},
                slow.tokenizer_json)
    check = tune(gpu, grid=[st.NgramConfig(num_draft_tokens=4)], profile=profile, progress=False).profile_check
    assert check.skipped == "the trace was recorded on NVIDIA H200, the profile measured on cpu"
    assert check.describe() == f"profile check: not made ({check.skipped})"
    mle = Trace(slow.steps, slow.requests, {**slow.run_info, "draft": {"method": "multi_layer_eagle", "num_steps": 2}},
                slow.tokenizer_json)
    assert check_profile(mle, profile).skipped == "the profile has no multi_layer_eagle timings"
    some = Trace(slow.steps, slow.requests, {**slow.run_info, "record": {"requests": [0], "every": 1}},
                 slow.tokenizer_json)
    assert "selection" in check_profile(some, profile).skipped
    every = Trace(slow.steps, slow.requests, {**slow.run_info, "record": {"every": 2, "requests": None}},
                  slow.tokenizer_json)
    assert check_profile(every, profile).ratio == pytest.approx(0.8, rel=1e-6)  # whole iterations, a sample


def test_profile_of_another_version_is_refused_naming_both(profile, tmp_path):
    old = json.loads(json.dumps(profile.data))
    old["version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(TuneError) as err:
        CostProfile.load(tmp_path / "old.json")
    assert "version 1" in str(err.value) and "version 2" in str(err.value) and "\n" not in str(err.value)
    for name in shipped_profiles():  # every profile spectool ships reads with this spectool
        assert CostProfile.load(name).data["version"] == 2


def test_cli_tune_prints_ranking_and_serving_flags(ngram_trace, profile, tmp_path, capsys):
    trace_path, profile_path, out = tmp_path / "run.sptrace", tmp_path / "p.json", tmp_path / "t.json"
    ngram_trace.save(trace_path)
    profile.save(profile_path)
    rc = cli_main(["tune", str(trace_path), "--profile", str(profile_path), "--grid", "num_draft_tokens=2,4,8",
                   "--grid", "max_bfs_breadth=1,4", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "--speculative-algorithm NGRAM" in text and "--speculative-ngram-max-bfs-breadth" in text
    saved = json.loads(out.read_text())
    assert len(saved["table"]) == 6
    best = saved["recommended"]
    assert saved["table"][0]["num_draft_tokens"] == best["num_draft_tokens"]
    assert saved["vllm_speculative_config"]["num_speculative_tokens"] == best["num_draft_tokens"] - 1
    tps = [r["predicted_tokens_per_s"] for r in saved["table"]]
    assert tps == sorted(tps, reverse=True)
    assert cli_main(["tune", str(tmp_path / "nope.sptrace")]) == 2
    assert cli_main(["tune", str(trace_path), "--grid", "bogus=1"]) == 2


def test_panel_predicts_what_tune_predicts_and_runs_beside_it(target, ngram_trace, profile):
    from spectool.widgets import TuningPanel

    panel = TuningPanel(target, trace=ngram_trace, profile=profile, max_new_tokens=MAX_NEW,
                        engine_kwargs={"max_seq_len": 128})
    panel.sliders["num_draft_tokens"].value = 4  # a slider move predicts at once
    expected = tune(ngram_trace, grid=[panel.config()], profile=profile, progress=False)
    pred = expected.predictions[0]
    assert f"{pred.mean_accept_length:.2f}" in panel.prediction.value
    assert html.escape(expected.profile_check.describe()) in panel.prediction.value  # how far to trust tokens/s
    assert list(panel.scatter.data[2].y) == [pytest.approx(pred.mean_accept_length)]
    assert f"tokens/s {expected.tokens_per_s(pred):.1f}" in panel.scatter.data[2].hovertext[0]

    sweep = panel.sweep(x="num_draft_tokens", x_values=[2, 4], y="max_bfs_breadth", y_values=[1, 3],
                        metric="mean_accept_length", source="predicted")
    for j, breadth in enumerate([1, 3]):
        for i, n in enumerate([2, 4]):
            cfg = panel.config(num_draft_tokens=n, max_bfs_breadth=breadth)
            got = tune(ngram_trace, grid=[cfg], progress=False).predictions[0].mean_accept_length
            assert sweep["values"][j][i] == pytest.approx(got)
    assert not panel.results  # nothing was decoded
    heat = panel.heatmap_figure.data[0]
    assert heat.colorbar.title.text == "accept length" and heat.texttemplate
    assert panel.heatmap_figure.layout.xaxis.title.text == "draft tokens (N)"

    seen = []
    measure = panel._measure

    def watched(config):
        seen.append((panel.run_button.disabled, panel.sweep_button.disabled))
        return measure(config)

    panel._measure = watched
    first, second = panel.run(), panel.run()  # the same configuration twice: one row, two runs
    assert seen == [(True, True), (True, True)] and not panel.run_button.disabled
    # Greedy decoding is lossless, so the measured accept length of the trace's own prompts is the prediction.
    assert first["mean_accept_length"] == pytest.approx(first["predicted_accept_length"])
    frame = panel.to_frame()
    assert len(frame) == 1 and frame["runs"].iloc[0] == 2
    assert frame["tokens_per_s_min"].iloc[0] == min(first["tokens_per_s"], second["tokens_per_s"])
    assert "2 runs" in panel.scatter.data[0].hovertext[0] and "accept length" in panel.scatter.data[0].hovertext[0]
    assert "predicted tokens/s" in panel.table.value and "<th" in panel.table.value
    panel.sort_by.value = "tokens_per_s"
    assert panel.table.value.count("<tr>") == 2


def test_panel_table_sorts_by_the_chosen_column(target, prompts):
    from spectool.widgets import TuningPanel

    panel = TuningPanel(target, prompts, draft_kind="ngram", max_new_tokens=6, engine_kwargs={"max_seq_len": 128})
    for n in (2, 6, 4):
        panel.run(num_draft_tokens=n)
    panel.sort_by.value = "num_draft_tokens"
    panel.sort_descending.value = False
    col = list(panel.to_frame().columns).index("num_draft_tokens")
    cells = [r.split("</td>")[col].rsplit(">", 1)[1] for r in panel.table.value.split("<tr>")[2:]]
    assert [int(c) for c in cells] == [2, 4, 6]


def test_iteration_gains_line_runs_up_by_output_position(ngram_trace):
    from spectool.tune.compare import iteration_gains

    same, small = tune(ngram_trace, grid=[st.NgramConfig(), st.NgramConfig(num_draft_tokens=2)],
                       progress=False).predictions
    gains = iteration_gains(ngram_trace, same)  # the recorded configuration predicts the recorded run
    assert (gains["saved"] == 0).all() and (gains["delta"] == 0).all()
    worse = iteration_gains(ngram_trace, small)
    assert len(worse) == small.accept_length.size  # one row per (iteration, request)
    assert worse["tokens"].sum() == small.accept_length.sum() + small.accept_length.size
    assert (worse["delta"].dropna() <= 0).all() and (worse["delta"] < 0).any()  # one draft token never gains more
    better = iteration_gains(small, ngram_trace)
    assert better["saved"].sum() > 0


def test_compare_view_shows_a_predicted_run_beside_the_recorded_one(ngram_trace):
    pytest.importorskip("ipywidgets")
    from spectool.widgets import CompareView

    small = tune(ngram_trace, grid=[st.NgramConfig(num_draft_tokens=2)], progress=False).predictions[0]
    cmp = CompareView(ngram_trace, small)  # the Prediction is shown as the run it predicts
    assert cmp.labels[1].startswith("B: predicted ngram") and "num_draft_tokens=2" in cmp.labels[1]
    rid = cmp.request
    side = cmp.sides[1]
    # Oracle: the predicted rows of that request, each covering its accepted drafts and a bonus.
    covering = [-1]
    for it, a in zip(small.iteration[small.request_id == rid], small.accept_length[small.request_id == rid]):
        covering += [int(it)] * (int(a) + 1)
    assert side["iteration"].tolist() == covering[:len(side["tokens"])]
    assert cmp.sides[0]["tokens"].tolist() == side["tokens"].tolist()  # greedy: the same output
