"""LiveDecode and TuningPanel: what they show must agree with what the engine decoded.

The oracle for LiveDecode is ``engine.generate`` on the same prompts (greedy, so the
same tokens); for TuningPanel it is a direct ``Engine(...).generate`` with the same
config. A scripted engine covers Stop and bad input without a model.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

import spectool as st
from spectool.widgets import LiveDecode, TuningPanel

MAX_NEW = 24
# The demo's editing prompts run to ~700 tokens.
MAX_SEQ_LEN = 1024



class ScriptedEngine:
    """Yields one event per ``step`` call from the test; honours request_stop()."""

    method = "ngram"

    def __init__(self, iterations: int = 1000) -> None:
        self.iterations = iterations
        self.stepped = threading.Semaphore(0)
        self.stopped = threading.Event()
        self.events_sent = 0

    def request_stop(self) -> None:
        self.stopped.set()

    def stream(self, prompts, max_new_tokens, temperature, record):
        for i in range(self.iterations):
            if self.stopped.is_set():
                return
            self.stepped.release()
            self.events_sent += 1
            yield SimpleNamespace(iteration=i, new_tokens={0: [7, 8, 9]}, accept_lengths={0: 2},
                                  prefill_tokens={0: 5} if i == 0 else {}, records=[], finished=[],
                                  stats={"tokens_per_s": 1.0, "mean_accept_length": 2.0, "iterations": i + 1})


@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cpu")


@pytest.fixture(scope="module")
def prompts(demo_model_dir):
    lines = [json.loads(x) for x in (demo_model_dir / "prompts.jsonl").read_text().splitlines()]
    return [x["prompt"] for x in lines if x["kind"] == "editing"][:2]


def test_live_decode_shows_what_generate_returns(target, prompts):
    # Two fresh engines: an N-gram engine's trie keeps what earlier calls decoded.
    def engine():
        return st.Engine(target, draft=st.NgramConfig(num_draft_tokens=6), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)

    expected = engine().generate(prompts, max_new_tokens=MAX_NEW, record=True)
    live = LiveDecode(engine(), prompts, max_new_tokens=MAX_NEW)
    stats = live.run()

    assert live.token_ids == expected.token_ids
    assert live.texts == expected.texts
    assert live.error is None and not live.running
    # One coloured span per accepted draft token shown: all the engine accepted, less what
    # max_new_tokens cut from each request's last iteration.
    steps = expected.trace.to_pandas().sort_values("iteration")
    per_request = {r: list(g["accept_length"]) for r, g in steps.groupby("request_id")}
    assert {r: [it[r] for it in live.accept_lengths if r in it] for r in per_request} == per_request
    coloured = live.text.value.count("title='accepted draft")
    accepted = sum(map(sum, per_request.values()))
    assert accepted - sum(a[-1] for a in per_request.values()) <= coloured <= accepted
    assert stats["mean_accept_length"] == pytest.approx(expected.stats.mean_accept_length)
    fig = live.to_figure()
    assert sum(sum(trace.y) for trace in fig.data) == sum(len(t) for t in expected.token_ids) - len(prompts)


def test_live_decode_start_runs_in_background_and_stop_ends_cleanly():
    engine = ScriptedEngine()
    letters = lambda ids: "".join(chr(65 + i) for i in ids)  # noqa: E731
    live = LiveDecode(engine, ["x"], max_new_tokens=10_000, decode=letters)
    live.start()
    assert live.running and live.start_button.disabled
    for _ in range(3):
        assert engine.stepped.acquire(timeout=10)
    live.stop()
    assert live.wait(timeout=10), "decoding did not stop"
    assert engine.stopped.is_set()
    assert not live.running and not live.start_button.disabled
    assert engine.events_sent < engine.iterations
    # Prefill token first, then each event's two accepted drafts and its bonus.
    assert live.token_ids[0][:4] == [5, 7, 8, 9]
    assert live.texts[0].startswith("FHIJ")


def test_live_decode_bad_input_is_a_message():
    live = LiveDecode(ScriptedEngine(), [], max_new_tokens=5)
    assert "no prompts" in live.message.value and live.start_button.disabled
    assert live.run() == {}
    live = LiveDecode(object(), ["x"])
    assert "stream" in live.message.value


def test_live_decode_engine_error_is_shown_not_raised():
    class Failing(ScriptedEngine):
        def stream(self, *args, **kwargs):
            raise ValueError("max_new_tokens too large")
            yield

    live = LiveDecode(Failing(), ["x"], max_new_tokens=5)
    live.run()
    assert "max_new_tokens too large" in live.message.value and not live.running


def test_tuning_run_matches_a_direct_generate(target, prompts):
    panel = TuningPanel(target, prompts, draft_kind="ngram", max_new_tokens=MAX_NEW,
                        engine_kwargs={"max_seq_len": MAX_SEQ_LEN})
    panel.sliders["num_draft_tokens"].value = 5
    panel.sliders["max_bfs_breadth"].value = 3
    row = panel.run()
    direct = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=5, max_bfs_breadth=3),
                       max_batch_size=len(prompts), max_seq_len=MAX_SEQ_LEN)
    expected = direct.generate(prompts, max_new_tokens=MAX_NEW, record=False)
    assert row["mean_accept_length"] == pytest.approx(expected.stats.mean_accept_length)
    assert row["num_draft_tokens"] == 5 and row["max_bfs_breadth"] == 3
    assert list(panel.scatter.data[0].y) == [row["mean_accept_length"]]
    assert "<table" in panel.table.value


def test_tuning_sweep_fills_heatmap_and_skips_invalid(target, prompts):
    panel = TuningPanel(target, prompts[:1], draft_kind="ngram", max_new_tokens=8,
                        engine_kwargs={"max_seq_len": MAX_SEQ_LEN})
    result = panel.sweep(x="min_bfs_breadth", x_values=[1, 4], y="max_bfs_breadth", y_values=[2, 3])
    values = result["values"]
    # min breadth 4 > max breadth 2 or 3 is refused by NgramConfig: those cells stay empty.
    assert values[0][1] != values[0][1] and values[1][1] != values[1][1]
    assert values[0][0] == values[0][0] and values[1][0] == values[1][0]
    assert "2 settings skipped" in panel.message.value
    assert panel.progress.value == panel.progress.max == 4
    assert len(panel.results) == 2
    fig = panel.to_figure()
    assert [t.type for t in fig.data] == ["scatter", "heatmap"]
    assert list(panel.heatmap_figure.data[0].z[0])[0] == values[0][0]


def test_tuning_bad_input_is_a_message(target):
    assert "draft_path" in TuningPanel(target, ["x"], draft_kind="eagle").message.value
    assert "draft_kind" in TuningPanel(target, ["x"], draft_kind="medusa").message.value
    panel = TuningPanel(target, ["x"], draft_kind="ngram")
    panel.sliders["min_bfs_breadth"].value = 9
    panel.sliders["max_bfs_breadth"].value = 2
    assert panel.run() is None and "min_bfs_breadth" in panel.message.value
    panel.sweep_x_values.value = "1, two"
    assert panel.sweep() is None and "two" in panel.message.value
    assert panel.sweep(x="topk", x_values=[1], y="max_bfs_breadth", y_values=[1]) is None
    assert "topk" in panel.message.value


def test_tuning_multi_layer_steps_stop_at_the_checkpoint_layers(target, demo_model_dir):
    path = demo_model_dir / "multi_layer_eagle"
    steps = TuningPanel(target, ["x"], draft_kind="multi_layer_eagle", draft_path=path).sliders["num_steps"].max
    # The engine is the oracle: it takes the slider's last value and refuses one more.
    st.Engine(target, draft=st.MultiLayerEagleConfig(path, num_steps=steps), max_batch_size=1, max_seq_len=64)
    with pytest.raises(ValueError, match="draft layer"):
        st.Engine(target, draft=st.MultiLayerEagleConfig(path, num_steps=steps + 1), max_batch_size=1,
                  max_seq_len=64)
