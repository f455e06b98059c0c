"""The greedy-verify Triton kernels (run on CPU through the Triton interpreter in a subprocess,
since TRITON_INTERPRET must be set before triton loads) against the torch reference, which
tests/test_verify.py checks against a brute-force oracle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

INTERPRETED = textwrap.dedent(
    """
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    sys.path.insert(0, {tests!r})
    import torch
    from test_verify import random_batch
    from spectool.verify import verify_greedy, verify_greedy_torch

    cases = 0
    # Small vocabularies with rounded logits make argmax ties and accepted paths common; 9000
    # spans several argmax chunks (ties across chunks too); N up to 64; one NaN-poisoned batch.
    for seed, (bs, n, vocab, dtype) in enumerate([
            (40, 8, 3, torch.float32), (30, 16, 2, torch.float32), (10, 33, 4, torch.float32),
            (5, 1, 5, torch.float32), (3, 16, 9000, torch.float32), (2, 64, 3, torch.float32),
            (6, 12, 4, torch.bfloat16), (4, 8, 5000, torch.float32)]):
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
        cases += 1
    print("triton-interpreted cases:", cases)
    """
)


def test_greedy_verify_kernels_under_interpreter_match_reference():
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", INTERPRETED.format(tests=tests)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "triton-interpreted cases: 8" in proc.stdout
