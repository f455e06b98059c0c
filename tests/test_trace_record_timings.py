"""Recording as the engine does it: iteration first, timings after; derived target top-1; sampling runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spectool as st
from spectool.trace import check
from spectool.trace.recorder import Recorder, pack_rows


def _row(it: int, rows: int = 1) -> dict:
    return {"iteration": it, "request_id": np.arange(rows, dtype=np.int32), "num_nodes": 1,
            "tokens": torch.full((rows, 1), it)}


def test_timings_land_on_their_own_iteration_across_hand_offs():
    rec = Recorder(None, {}, flush_every=2)  # hand-offs every 2 rows: the newest row must wait for its timings
    for it in range(7):
        rec.record_batch(_row(it, rows=2 if it % 3 else 1))
        rec.record_timings({"verify_us": 10.0 * it, "iteration_us": it + 0.5})
    steps = rec.close().steps.to_pandas()
    assert (steps["verify_us"] == 10.0 * steps["iteration"]).all()
    assert (steps["iteration_us"] == steps["iteration"] + 0.5).all()
    assert len(steps) == sum(2 if it % 3 else 1 for it in range(7))


def test_record_timings_needs_a_pending_iteration_and_known_names():
    rec = Recorder(None, {})
    with pytest.raises(ValueError, match="must follow record_batch"):
        rec.record_timings({"verify_us": 1.0})
    rec.record_batch(_row(0))
    with pytest.raises(ValueError, match="unknown trace field"):
        rec.record_timings({"verfy_us": 1.0})
    rec.iteration_rows()  # hands the iteration to the writer: it can no longer change
    with pytest.raises(ValueError, match="must follow record_batch"):
        rec.record_timings({"verify_us": 1.0})
    rec.close()


def test_target_top1_is_derived_from_the_topk():
    rng = np.random.default_rng(0)
    top_i = torch.from_numpy(rng.integers(0, 50, (3, 4, 5)))
    top_p = torch.from_numpy(np.sort(rng.random((3, 4, 5)), axis=-1)[..., ::-1].copy()).float()
    rec = Recorder(None, {})
    rec.record_batch({"iteration": 0, "num_nodes": 4, "request_id": np.arange(3)},
                     pack_rows([("target_topk_tokens", top_i), ("target_topk_probs", top_p)]))
    steps = rec.close().steps
    np.testing.assert_array_equal(np.stack(steps["target_argmax"].to_numpy(zero_copy_only=False)),
                                  top_i[..., 0].numpy())
    np.testing.assert_array_equal(np.stack(steps["target_argmax_prob"].to_numpy(zero_copy_only=False)),
                                  top_p[..., 0].numpy())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_trace_checks_out_greedy_and_sampling(temperature):
    demo = st.demo_model()
    target = st.load(f"{demo}/target", device="cpu")
    engine = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=6), max_batch_size=2, max_seq_len=512)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12]]
    res = engine.generate(prompts, max_new_tokens=12, temperature=temperature, seed=2, ignore_eos=True)
    assert check.check_trace(res.trace) is None
    steps = res.trace.steps.to_pandas()
    assert (steps["iteration_us"] > 0).all()
    top1 = [p[0] for row in steps["target_topk_probs"] for p in np.asarray(row).reshape(-1, 5)]
    assert np.allclose(np.concatenate(steps["target_argmax_prob"].to_list()), top1)
