"""The engine on CUDA syncs the host once per iteration (the packed result table), also when
requests leave and the batch is rebuilt, and the running batch advanced on the device gives the
same tokens as plain decoding.

Syncs are counted with ``torch.cuda.set_sync_debug_mode("warn")``: stream and device syncs
and blocking copies warn, attributed to the Python line that made them. Event waits do not
warn there, so the test makes ``torch.cuda.Event.synchronize`` warn too (the engine waits on
an event for its host table); those of the phase timer (for its last phase) and of the
recorder (for its pinned copies) are left out.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from test_engine_gpu import draft_config  # noqa: E402
from test_engine_support import cut_prompts, demo_token_streams  # noqa: E402

import spectool as st  # noqa: E402

METHODS = ["none", "ngram", "eagle", "multi_layer_eagle"]



@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(target, demo_model_dir):
    return cut_prompts(demo_token_streams(target, demo_model_dir), 4, seed=5, min_len=16, max_len=64)


@pytest.mark.parametrize("record", [False, True], ids=["record_off", "record_on"])
@pytest.mark.parametrize("method", METHODS)
def test_one_host_sync_per_iteration_also_when_the_batch_changes(target, demo_model_dir, prompts, method, record):
    engine = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=len(prompts),
                       max_seq_len=256)
    engine.generate(prompts, max_new_tokens=16, ignore_eos=True, record=record)  # captures the graphs
    stream = engine.stream(prompts, max_new_tokens=64, ignore_eos=True, record=record)
    counts, around_release, left = [], [], False
    original_wait = torch.cuda.Event.synchronize

    def reported_wait(event):
        warnings.warn("event synchronize", stacklevel=2)
        return original_wait(event)
    torch.cuda.Event.synchronize = reported_wait
    try:
        while True:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    event = next(stream)
                except StopIteration:
                    break
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)
                     and not w.filename.endswith(("timing.py", "recorder.py"))]
            # An admission reads its first tokens on the host too. Releases and the batch rebuilt
            # after them copy their host lists from pinned memory, queued behind the draft the GPU
            # may still be running: a pageable copy there waited for it.
            if not event.prefill_tokens:
                counts.append((len(syncs), [f"{w.filename}:{w.lineno}" for w in syncs]))
                if left or event.finished:
                    around_release.append(counts[-1])
            left = bool(event.finished)
    finally:
        torch.cuda.Event.synchronize = original_wait
        stream.close()
    assert len(counts) >= 10
    assert all(n == 1 for n, _ in counts), counts
    if method != "none":  # their requests finish at different iterations, some leaving a running batch
        assert len(around_release) > 1


@pytest.mark.parametrize("method", METHODS)
def test_requests_joining_and_leaving_keep_greedy_lossless(target, demo_model_dir, method):
    """Eight prompts through two slots with a stop token: the device-side batch is rebuilt on
    every join and leave and advanced in between; outputs equal plain decoding's."""
    prompts = cut_prompts(demo_token_streams(target, demo_model_dir), 8, seed=7, min_len=8, max_len=48)
    plain = st.Engine(target, max_batch_size=8, max_seq_len=256).generate(
        prompts, max_new_tokens=32, ignore_eos=True, record=False).token_ids
    stop = plain[0][5]
    engine = st.Engine(target, draft=draft_config(method, demo_model_dir), max_batch_size=2, max_seq_len=256)
    result = engine.generate(prompts, max_new_tokens=32, stop_token_ids=[stop], record=False)
    for want, out in zip(plain, result.token_ids):
        assert out == (want[:want.index(stop) + 1] if stop in want else want)
    # The phase timer reuses its CUDA events across iterations: every iteration still times its verify.
    assert all(v > 0 for v in result.stats.columns["verify_us"])
