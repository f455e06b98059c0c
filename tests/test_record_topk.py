"""The recorded target top-k starts with the token the verifier took, also among tied logits."""

import torch

from spectool.engine import _led_by


def test_the_verifiers_argmax_leads_the_recorded_topk():
    top_i = torch.tensor([[[280, 262, 5], [7, 8, 9], [3, 1, 2]]])
    argmax = torch.tensor([[262, 7, 4]])
    # moved to the front (the old first takes its place), kept, and put first when top-k missed it.
    assert _led_by(top_i, argmax).tolist() == [[[262, 280, 5], [7, 8, 9], [4, 1, 2]]]


def test_tied_logits_record_the_lowest_id_the_greedy_verify_takes():
    logits = torch.zeros(1, 1, 300)
    logits[0, 0, [262, 280]] = 5.0  # an exact tie
    argmax = logits.argmax(-1)
    assert argmax.item() == 262  # what verify_greedy_torch (and the Triton verify) take
    top_i = _led_by(torch.tensor([[[280, 262]]]), argmax)
    assert top_i[0, 0, 0].item() == 262
