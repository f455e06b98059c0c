"""Helpers shared by the engine tests: the demo target in float32 and seeded prompts cut
from its held-out prompts. The demo model's directory comes from the ``demo_model_dir``
fixture of conftest.py.

(Named test_engine_* so it sits with the tests it serves; it holds no tests itself.)
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import torch

import spectool as st


@cache
def load_demo_target(demo_dir: Path):
    """The demo target on CPU in float32 (the dtype greedy outputs are compared in), loaded once."""
    return st.load(demo_dir / "target", device="cpu", dtype=torch.float32)


def demo_token_streams(target, demo_dir: Path) -> list[list[int]]:
    """Every held-out demo prompt, tokenized."""
    lines = [json.loads(x) for x in (demo_dir / "prompts.jsonl").read_text().splitlines() if x.strip()]
    return [target.encode(x["prompt"]) for x in lines]


def cut_prompts(streams: list[list[int]], count: int, seed: int, min_len: int = 12,
                max_len: int = 80, repetitive_every: int = 5) -> list[list[int]]:
    """``count`` prompts cut from ``streams`` at seeded offsets and lengths.

    Every ``repetitive_every``-th prompt is a short seeded chunk repeated until the
    prompt is full: the case where N-gram drafts are accepted deep into the tree.
    """
    rng = random.Random(seed)
    out = []
    for i in range(count):
        src = rng.choice([s for s in streams if len(s) > max_len])
        n = rng.randint(min_len, max_len)
        if repetitive_every and i % repetitive_every == repetitive_every - 1:
            w = rng.randint(3, 12)
            s = rng.randrange(len(src) - w)
            chunk = src[s:s + w]
            out.append((chunk * (n // w + 1))[:n])
        else:
            s = rng.randrange(len(src) - n)
            out.append(src[s:s + n])
    return out
