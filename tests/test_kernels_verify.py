"""The greedy-verify Triton kernels against the torch reference (which tests/test_verify.py checks
against a brute-force oracle), on the CPU via TRITON_INTERPRET=1: unless this process started
with it, the file re-runs itself in a child pytest that does (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from test_verify import random_batch

from spectool.verify import verify_greedy, verify_greedy_parts, verify_greedy_torch


def test_kernels_in_an_interpreter_subprocess(triton_interpreter_child):
    triton_interpreter_child()


@pytest.mark.triton_interpreter
def test_greedy_verify_kernels_match_reference():
    # Small vocabularies with rounded logits make argmax ties and accepted paths common; 9000
    # spans several argmax chunks (ties across chunks too); N up to 64; one NaN-poisoned batch.
    cases = [(40, 8, 3, torch.float32), (30, 16, 2, torch.float32), (10, 33, 4, torch.float32),
             (5, 1, 5, torch.float32), (3, 16, 9000, torch.float32), (2, 64, 3, torch.float32),
             (6, 12, 4, torch.bfloat16), (4, 8, 5000, torch.float32)]
    for seed, (bs, n, vocab, dtype) in enumerate(cases):
        tree, g = random_batch(bs, n, vocab, seed)
        logits = torch.randn(bs, n, vocab, generator=g)
        logits = (logits.round() if vocab < 10 else (logits * 2).round()).to(dtype)
        if seed == 7:
            logits[0, 0, 4500] = float("nan")
            logits[1, 3, 17] = float("nan")
        want = verify_greedy_torch(tree, logits)
        got = verify_greedy(tree, logits)  # TRITON_INTERPRET=1: the Triton path on CPU tensors
        for name in ("status", "accept_path", "accept_length", "bonus", "target_argmax"):
            w, t = getattr(want, name), getattr(got, name)
            assert w.dtype == t.dtype and torch.equal(w, t), (seed, name, w, t)
        assert got.coins.isnan().all()


def slice_maxima(logits: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``parts`` equal vocabulary slices' largest logit and its first id (NaN as the largest),
    what the ranks of a target split by vocabulary exchange."""
    n = logits.shape[-1] // parts
    x = logits.float()
    x = torch.where(x.isnan(), float("inf"), x)
    vals, ids = [], []
    for r in range(parts):
        i = x[..., r * n:(r + 1) * n].argmax(-1)
        vals.append(x[..., r * n:(r + 1) * n].gather(-1, i[..., None])[..., 0])
        ids.append(i + r * n)
    return torch.stack(vals, -1), torch.stack(ids, -1)


def _check_parts_decision(tree, logits, parts):
    want = verify_greedy_torch(tree, logits)
    got = verify_greedy_parts(tree, *slice_maxima(logits, parts))
    for name in ("status", "accept_path", "accept_length", "bonus", "target_argmax"):
        w, t = getattr(want, name), getattr(got, name)
        assert w.dtype == t.dtype and torch.equal(w, t), (parts, name, w, t)


def _parts_cases():
    # Rounded logits over small vocabularies: ties within a slice and across slices are common.
    for seed, (bs, n, vocab, parts) in enumerate([(20, 8, 6, 2), (10, 16, 12, 4), (6, 33, 40, 8), (4, 1, 8, 2)]):
        tree, g = random_batch(bs, n, vocab, seed)
        yield tree, (torch.randn(bs, n, vocab, generator=g) * 2).round(), parts


def test_greedy_verify_from_slice_maxima_equals_verify_of_the_joined_logits():
    for tree, logits, parts in _parts_cases():
        _check_parts_decision(tree, logits, parts)


@pytest.mark.triton_interpreter
def test_greedy_decide_kernel_from_slice_maxima_equals_the_reference():
    for tree, logits, parts in _parts_cases():  # TRITON_INTERPRET=1: verify_greedy_parts takes the kernel
        _check_parts_decision(tree, logits, parts)
