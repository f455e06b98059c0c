"""N-gram decoding on CUDA: both graphs of a bucket (the whole tree, and the roots alone for
an iteration where no row matched the trie) are captured in the first iteration, so no
capture stalls the stream later, and decoding still equals plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import spectool as st  # noqa: E402

N = 12


@pytest.fixture(scope="module")
def target(demo_model_dir):
    return st.load(demo_model_dir / "target", device="cuda", dtype=torch.float32)


@pytest.mark.parametrize("record", [True, False], ids=["record", "no_record"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
def test_both_tree_sizes_are_captured_in_the_first_iteration(target, record, temperature):
    # Distinct random tokens: the prompt's last token has no continuation in the trie, so
    # iterations start with the roots alone; the demo model's output soon repeats itself.
    g = torch.Generator().manual_seed(3)
    prompt = torch.randperm(target.config.vocab_size, generator=g)[:48].tolist()
    engine = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=N), max_batch_size=1, max_seq_len=512)
    captures, sizes, tokens = [], [], []
    for event in engine.stream([prompt], max_new_tokens=200, temperature=temperature, ignore_eos=True,
                               record=record, seed=1):
        captures.append(engine.graph_stats()["captures"])
        tokens += [event.prefill_tokens[0]] if 0 in event.prefill_tokens else []
        tokens += event.new_tokens.get(0, [])
        if record:
            sizes += [row.num_nodes for row in event.records]
    if record:
        assert {1, N} <= set(sizes), "the run must verify both tree sizes for the test to mean anything"
    assert captures[0] > 0
    assert captures[-1] == captures[0], f"graphs captured after the first iteration: {captures}"
    if temperature == 0.0:
        plain = st.Engine(target, draft=None, max_batch_size=1, max_seq_len=512)
        want = plain.generate([prompt], max_new_tokens=200, ignore_eos=True, record=False).token_ids[0]
        assert tokens == want
