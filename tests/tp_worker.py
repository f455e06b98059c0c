"""One rank of a tensor-parallel test run (started by spectool.cli.launch.launch from test_tensor_parallel.py).

    python tests/tp_worker.py logits OUT_DIR TP        # prefill / decode / tree-verify logits of the demo target
    python tests/tp_worker.py generate OUT_DIR TP      # greedy output of every draft method
    python tests/tp_worker.py fail OUT_DIR TP          # rank 1 raises after joining; rank 0 waits in a collective

Every rank writes OUT_DIR/<mode>_rank<R>.json, so the test can also check that the ranks agree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import spectool as st
from spectool.model.kv_cache import KVCache

PROMPTS = [[5, 17, 300, 41, 9, 77, 1000, 3], [12, 8, 800, 64, 2048, 31], [400, 401, 402, 400, 401]]


def demo_target(tp: int):
    return st.load(st.demo_model() / "target", device="cpu", dtype=torch.float32, tp_size=tp)


def forward_logits(tp: int) -> dict:
    """Logits of a prefill, a one-token decode and a 4-node tree verify through the static cache."""
    target = demo_target(tp)
    model = target.model
    cache = KVCache.for_model(model.local_config, 2, 64, torch.float32, "cpu")
    prompt = torch.tensor([PROMPTS[0]])
    L = prompt.shape[1]
    slots, zero = torch.tensor([0]), torch.tensor([0])
    with torch.no_grad():
        prefill = model.logits(model(prompt, torch.arange(L)[None], cache, slots, zero, None, kv_len=L))
        decode = model.logits(model(torch.tensor([[7]]), torch.tensor([[L]]), cache, slots, torch.tensor([L]),
                                    None, kv_len=L + 1))
        # Tree [root, a, b, a->c]: parents [-1, 0, 0, 1].
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None]
        verify = model.logits(model(torch.tensor([[9, 11, 13, 15]]), torch.tensor([[L + 1, L + 2, L + 2, L + 3]]),
                                    cache, slots, torch.tensor([L + 1]), mask, kv_len=L + 5))
    return {name: t.tolist() for name, t in (("prefill", prefill), ("decode", decode), ("verify", verify))}


def generate(tp: int) -> dict:
    """Greedy outputs of plain decoding and of every draft method on the demo target."""
    root = st.demo_model()
    target = demo_target(tp)
    drafts = {"none": None, "ngram": st.NgramConfig(num_draft_tokens=8),
              "eagle": st.EagleConfig(root / "eagle", num_steps=3, topk=2, num_draft_tokens=6),
              "multi_layer_eagle": st.MultiLayerEagleConfig(root / "multi_layer_eagle", num_steps=3)}
    out = {}
    for name, draft in drafts.items():
        engine = st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=128)
        result = engine.generate(PROMPTS, max_new_tokens=24, record=True)
        out[name] = {"tokens": result.token_ids, "recorded": result.trace is not None,
                     "tp_size": None if result.trace is None else result.trace.run_info["model"]["tp_size"]}
    return out


def fail(tp: int) -> dict:
    target = demo_target(tp)
    if target.tp.rank == 1:
        raise RuntimeError("planted failure on rank 1")
    target.tp.all_reduce(torch.ones(4))  # waits for rank 1, which never comes
    return {}


def main() -> None:
    mode, out, tp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    result = {"logits": forward_logits, "generate": generate, "fail": fail}[mode](tp)
    rank = os.environ.get("RANK", "0")
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
