"""One rank of a tensor-parallel test run (started by spectool.cli.launch.launch from test_tensor_parallel.py).

    python tests/tp_worker.py logits OUT_DIR TP        # prefill / decode / tree-verify logits of the demo target
    python tests/tp_worker.py families OUT_DIR TP      # the same for each checkpoint in $SPECTOOL_TEST_MODELS (JSON)
    python tests/tp_worker.py generate OUT_DIR TP      # greedy output of every draft method
    python tests/tp_worker.py exchange OUT_DIR TP      # argmax / top-k from the vocabulary slices; all-gathers
    python tests/tp_worker.py fail OUT_DIR TP          # rank 1 raises after joining; rank 0 waits in a collective
    python tests/tp_worker.py refuse OUT_DIR TP        # the errors of the loads in $SPECTOOL_TEST_LOADS (JSON)

Every rank writes OUT_DIR/<mode>_rank<R>.json, so the test can also check that the ranks agree.
$SPECTOOL_TEST_DEVICE picks the device (default cpu; cuda for the GPU tests).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import spectool as st
from spectool.draft.tree import chain_tree
from spectool.model.kv_cache import KVCache
from spectool.verify import verify_greedy_parts

PROMPTS = [[5, 17, 300, 41, 9, 77, 1000, 3], [12, 8, 800, 64, 2048, 31], [400, 401, 402, 400, 401]]


def demo_target(tp: int, model: str | Path | None = None):
    return st.load(model or st.demo_model() / "target", device=os.environ.get("SPECTOOL_TEST_DEVICE", "cpu"),
                   dtype=torch.float32, tp_size=tp)


def forward_logits(tp: int, checkpoint: str | Path | None = None) -> dict:
    """Logits of a prefill, a one-token decode and a 4-node tree verify through the static cache."""
    target = demo_target(tp, checkpoint)
    model, dev = target.model, target.device
    cache = KVCache.for_model(model.local_config, 2, 64, torch.float32, dev)
    prompt = torch.tensor([PROMPTS[0]], device=dev) % target.config.vocab_size
    L = prompt.shape[1]

    def t(rows):
        return torch.tensor(rows, device=dev)

    slots, zero = t([0]), t([0])
    with torch.no_grad():
        prefill = model.logits(model(prompt, torch.arange(L, device=dev)[None], cache, slots, zero, None, kv_len=L))
        decode = model.logits(model(t([[7]]), t([[L]]), cache, slots, t([L]), None, kv_len=L + 1))
        # Tree [root, a, b, a->c]: parents [-1, 0, 0, 1].
        mask = t([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]).bool()[None]
        verify = model.logits(model(t([[9, 11, 13, 15]]), t([[L + 1, L + 2, L + 2, L + 3]]), cache, slots, t([L + 1]),
                                    mask, kv_len=L + 5))
    return {name: t.tolist() for name, t in (("prefill", prefill), ("decode", decode), ("verify", verify))}


def families(tp: int) -> dict:
    """forward_logits of each checkpoint in $SPECTOOL_TEST_MODELS."""
    return {path: forward_logits(tp, path) for path in json.loads(os.environ["SPECTOOL_TEST_MODELS"])}


def generate(tp: int) -> dict:
    """Greedy outputs of plain decoding and of every draft method on the demo target."""
    root = st.demo_model()
    target = demo_target(tp)
    drafts = {"none": None, "ngram": st.NgramConfig(num_draft_tokens=8),
              "eagle": st.EagleConfig(root / "eagle", num_steps=3, topk=2, num_draft_tokens=6),
              "multi_layer_eagle": st.MultiLayerEagleConfig(root / "multi_layer_eagle", num_steps=3),
              "eagle3": st.Eagle3Config(root / "eagle3", num_steps=3, topk=2, num_draft_tokens=6)}
    out = {}
    for name, draft in drafts.items():
        engine = st.Engine(target, draft=draft, max_batch_size=2, max_seq_len=128)
        result = engine.generate(PROMPTS, max_new_tokens=24, record=True)
        out[name] = {"tokens": result.token_ids, "recorded": result.trace is not None,
                     "tp_size": None if result.trace is None else result.trace.run_info["model"]["tp_size"]}
        out[name]["has_corpus"] = getattr(engine.drafter, "corpus", None) is not None
        if result.trace is not None:
            out[name]["steps"] = trace_steps(result.trace)
            out[name]["model"] = result.trace.run_info["model"]
    return out


def trace_steps(trace) -> dict:
    """Every step column of a trace but the timings, as JSON-able lists."""
    steps = trace.steps
    cols = steps.drop_columns([c for c in steps.column_names if c.endswith("_us")]).to_pydict()
    cols["mask_packed"] = [m.hex() for m in cols["mask_packed"]]
    return cols


def planted_logits(vocab: int, tp: int) -> torch.Tensor:
    """[3, 4, vocab] random logits with ties planted across the slices of ``tp`` ranks and within one."""
    logits = torch.randn(3, 4, vocab, generator=torch.Generator().manual_seed(0))
    n = vocab // tp
    logits[0, 0, [5, n + 5]] = 9.0  # the same best value on rank 0 and on rank 1
    logits[0, 1, [n + 7, n + 3]] = 9.0  # twice on rank 1
    logits[1, 2, [n - 1, n]] = 9.0  # on both sides of the boundary
    logits[2, 3, [2, 40, n + 1, n + 2]] = 9.0  # top-k ranks four equal values
    return logits


def planted_tree(logits: torch.Tensor):
    """A chain per row whose drafts follow the argmax for two nodes, then go astray."""
    tokens = torch.randint(0, logits.shape[-1], logits.shape[:2], generator=torch.Generator().manual_seed(1))
    tokens[:, 1:3] = logits.argmax(-1)[:, :2]
    return chain_tree(tokens, torch.ones(tokens.shape), torch.tensor([10, 20, 30]))


def sample(engine) -> list[list[int]]:
    """A short sampled run of EAGLE drafts (seeded)."""
    return engine.generate(PROMPTS[:2], max_new_tokens=4, temperature=1.0, seed=3).token_ids


def eagle_engine(target):
    return st.Engine(target, draft=st.EagleConfig(st.demo_model() / "eagle", num_steps=3, topk=2,
                                                  num_draft_tokens=6), max_batch_size=2, max_seq_len=64)


def exchange(tp: int) -> dict:
    """From each rank's slice of the planted logits: the greedy decision and the top-5 (softmax and
    raw); then the shape of every tensor all-gathered in a greedy run (EAGLE drafts, recording on)
    and in a sampling run."""
    target = demo_target(tp)
    vocab, rank = target.config.vocab_size, target.tp.rank
    logits = planted_logits(vocab, tp)
    n = vocab // tp
    local = logits[..., rank * n:(rank + 1) * n]
    res = verify_greedy_parts(planted_tree(logits), *target.tp.argmax_parts(local))
    probs, ids = target.tp.topk(local, 5, softmax=True)
    raw, raw_ids = target.tp.topk(local, 5)
    out = {"decision": {k: getattr(res, k).tolist() for k in ("status", "accept_path", "accept_length", "bonus",
                                                              "target_argmax")},
           "topk": [probs.tolist(), ids.tolist()], "raw_topk": [raw.tolist(), raw_ids.tolist()]}

    gathered: list[list[int]] = []
    all_gather = dist.all_gather

    def logged(parts, tensor, *args, **kwargs):
        gathered.append(list(tensor.shape))
        return all_gather(parts, tensor, *args, **kwargs)

    dist.all_gather = logged
    try:
        engine = eagle_engine(target)
        engine.generate(PROMPTS[:2], max_new_tokens=8, record=True)
        out["greedy_gathers"], gathered[:] = list(gathered), []
        out["sampled"] = sample(engine)
        out["sampling_gathers"] = list(gathered)
    finally:
        dist.all_gather = all_gather
    return out


def refuse(tp: int) -> dict:
    """Each load of $SPECTOOL_TEST_LOADS ([[checkpoint, device, tp_size], ...]): its error, and
    whether a process group existed by then (none may: the check comes before any work)."""
    out = []
    for model, device, tp_size in json.loads(os.environ["SPECTOOL_TEST_LOADS"]):
        try:
            st.load(model, device=device, tp_size=tp_size)
            out.append({"error": None})
        except ValueError as e:
            out.append({"error": str(e), "group": dist.is_initialized()})
    return {"loads": out}


def fail(tp: int) -> dict:
    target = demo_target(tp)
    if target.tp.rank == 1:
        raise RuntimeError("planted failure on rank 1")
    target.tp.all_reduce(torch.ones(4))  # waits for rank 1, which never comes
    return {}


def main() -> None:
    mode, out, tp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    modes = {"logits": forward_logits, "families": families, "generate": generate, "exchange": exchange,
             "refuse": refuse, "fail": fail}
    result = modes[mode](tp)
    rank = os.environ.get("RANK", "0")
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
