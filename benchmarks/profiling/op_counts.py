"""How many kernels each phase of a speculative iteration would launch, counted on the CPU.

    python3 benchmarks/speculative.py --profile ops                  # demo model, bs 1, every method
    python3 benchmarks/speculative.py --profile ops --methods eagle --new-tokens 32

Explains: docs/BENCHMARKS.md "Speculative decoding" (its batch-1 cells). Time: 1 to 2 minutes on the CPU.

At batch 1 on the H200 an iteration is bound by the number of small kernels (each costs
3-5 µs even inside a CUDA graph), not by bytes. This script counts them without a GPU: a
``TorchDispatchMode`` sees every aten op the engine runs, and every op that would be a
kernel is counted (view and metadata ops such as view/reshape/expand/slice/select, and
bare allocations, are not). Where the GPU path dispatches to a Triton kernel instead of
the torch code the CPU runs (RMSNorm, RoPE + cache write, SiLU·mul, cached attention,
greedy verify, the tree-index kernel, the drafters' softmax + top-k, the KV commit; the
embedding is one aten op either way) the count is that kernel's launches, and the
forward's CPU-only range checks count nothing. Graph-input copies are counted the way
``GraphRunner`` makes them (a copy per input, skipped for the same unmodified tensor).

Counts are per iteration (mean over a greedy run after a warm-up run on the same
engine; prefill excluded), for plain decoding, EAGLE (5 steps, top-k 4, 16 tokens),
multi-layer EAGLE (4 steps) and N-gram, split into: each graphed function (draft,
extend / per-layer extend, verify step), graph-input copies, and ops outside graphs by
timer phase. Inside a drafter's graphs the draft layer's forward (embedding and
layer), the lm_head and everything else (softmax, top-k, tree bookkeeping) are split.
Host syncs (``.item()``-like ops) inside graphed code are counted too; they must be 0.
Prints tables; writes op_counts.json to $OUT (or --out DIR) when set.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import torch
from speculative import add_common_arguments, draft_config, load_target, run_meta, workload_prompts, write_json
from torch.utils._python_dispatch import TorchDispatchMode

import spectool as st
import spectool.draft.eagle as eagle_module
import spectool.draft.tree as tree_module
import spectool.engine as engine_module
import spectool.kernels.ops as ops
import spectool.model.llama as llama
import spectool.timing as timing
from spectool.model.draft_layer import DraftLayer

METHODS = ("plain", "eagle", "multi_layer_eagle", "ngram")

# Ops that launch nothing: views, metadata and bare allocations (free inside a CUDA graph).
NOT_KERNELS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "as_strided", "t", "transpose",
    "permute", "unsqueeze", "squeeze", "slice", "select", "detach", "alias", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "diagonal", "view_as", "expand_as", "lift_fresh",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
})
# Ops that read a device value on the host: a sync, forbidden in graphed code.
SYNCS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"})

# (module, name, Triton launches on CUDA): the GPU path runs these as fused kernels.
TRITON_PATHS = (
    (ops, "rms_norm", 1), (ops, "add_rms_norm", 1), (ops, "rope", 1), (ops, "rope_write_kv", 1),
    (ops, "silu_mul", 1), (ops, "cached_attention", 2),  # split-KV pass + merge
    (engine_module, "verify_greedy", 3),  # chunked argmax + decision kernel + the coins' fill
    (engine_module, "commit_kv", 1),  # k and v moved by one kernel (kernels/gather.py)
    (tree_module, "reconstruct_indices_from_tree_mask", 1),
    # softmax + top-k of the draft heads (rows up to topk.TRITON_MAX_ROW, as the demo's vocabulary)
    (eagle_module, "row_topk", 1), (llama, "row_topk", 1), (tree_module, "row_topk", 1),
    (llama, "check_forward_args", 0),  # its range checks run only off CUDA
)


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops by the label path active when they run."""

    def __init__(self) -> None:
        super().__init__()
        self.path: list[str] = []
        self.counts: Counter[tuple[tuple[str, ...], str]] = Counter()
        self.paused = 0
        self.head_weights: list[torch.Tensor] = []  # lm_head weights: ops.linear on them counts as "lm_head"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # in-place variants count as their op
        if not self.paused and name not in NOT_KERNELS:
            self.add(name)
        return func(*args, **(kwargs or {}))

    def add(self, op: str, n: int = 1) -> None:
        self.counts[(tuple(self.path), op)] += n

    @contextlib.contextmanager
    def label(self, name: str) -> Iterator[None]:
        self.path.append(name)
        try:
            yield
        finally:
            self.path.pop()

    @contextlib.contextmanager
    def paused_as(self, op: str, launches: int) -> Iterator[None]:
        """Count ``launches`` for ``op`` and nothing that runs inside."""
        if not self.paused and launches:
            self.add(op, launches)
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def labelled(counter: OpCounter, name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with counter.label(name):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def patched(counter: OpCounter) -> Iterator[None]:
    """Triton-path functions count their launches; timer phases and draft layers label their ops."""
    saved = []

    def replace(owner, name, new):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    for owner, name, launches in TRITON_PATHS:
        original = getattr(owner, name)

        def fused(*args, _original=original, _name=name, _launches=launches, **kwargs):
            with counter.paused_as(f"triton:{_name}", _launches):
                return _original(*args, **kwargs)
        replace(owner, name, fused)

    timer_call = timing.PhaseTimer.__call__

    @contextlib.contextmanager
    def phase(self, name):
        with counter.label(f"phase:{name}"), timer_call(self, name):
            yield
    replace(timing.PhaseTimer, "__call__", phase)
    replace(DraftLayer, "forward", labelled(counter, "part:draft layer", DraftLayer.forward))
    linear = ops.linear

    def head_or_linear(x, weight, *args, **kwargs):  # the drafters run the head through ops.linear
        if any(weight is w for w in counter.head_weights):
            with counter.label("part:lm_head"):
                return linear(x, weight, *args, **kwargs)
        return linear(x, weight, *args, **kwargs)
    replace(ops, "linear", head_or_linear)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def instrument_engine(counter: OpCounter, engine: st.Engine) -> None:
    """Label each graphed function, its graph-input copies, prefill and the shared embedding/head."""
    runners = {"verify step": engine._greedy_runner, "verify step (record)": engine._greedy_record_runner,
               "verify step (sampling)": engine._sampling_runner(0, 1.0, False)}
    drafter = engine.drafter
    if hasattr(drafter, "_extend_runner"):  # EAGLE and multi-layer EAGLE: the extend after a verify
        runners["extend"] = drafter._extend_runner
    if hasattr(drafter, "_draft_runner"):  # EAGLE's draft alone, after a prefill or a change of batch
        runners["draft"] = drafter._draft_runner
    for name, runner in runners.items():
        runner.fn = graphed(counter, name, runner.fn)
    engine._prefill = labelled(counter, "prefill", engine._prefill)
    model = engine.model
    model.embed_tokens.forward = labelled(counter, "part:embedding", model.embed_tokens.forward)
    model.lm_head.forward = labelled(counter, "part:lm_head", model.lm_head.forward)
    counter.head_weights.append(model.lm_head.weight)  # the drafters' head calls (see patched)
    model.forward = labelled(counter, "part:target forward", model.forward)
    model.logits = labelled(counter, "part:target logits", model.logits)


def graphed(counter: OpCounter, name: str, fn: Callable) -> Callable:
    """``fn`` labelled as graph ``name``, plus the input copies GraphRunner would make on CUDA."""
    filled: dict[str, tuple[torch.Tensor, int]] = {}

    def wrapper(**tensors):
        with counter.label(f"inputs:{name}"):
            copied = set()
            for key, t in tensors.items():
                last = filled.get(key)
                if t.is_inference() or last is None or last[0] is not t or last[1] != t._version:
                    copied.add(t.dtype)
                filled[key] = (t, t._version)
            # GraphRunner copies a call's changed inputs with one _foreach_copy_: a launch per dtype.
            for _ in copied:
                counter.add("copy (graph inputs, one per dtype)")
        with counter.label(f"graph:{name}"):
            return fn(**tensors)
    return wrapper


def row_of(path: tuple[str, ...]) -> tuple[str, str] | None:
    """(row, part) of a label path: the graph (or 'outside graphs') and the part inside it."""
    if "prefill" in path:
        return None
    for i in range(len(path) - 1, -1, -1):
        kind, _, name = path[i].partition(":")
        if kind == "graph":
            parts = [p.partition(":")[2] for p in path[i + 1:] if p.startswith("part:")]
            return f"graph: {name}", parts[0] if parts else "bookkeeping"
        if kind == "inputs":
            return "graph input copies", name
    phases = [p.partition(":")[2] for p in path if p.startswith("phase:")]
    return "outside graphs", phases[-1] if phases else "engine"


def count_method(target, method: str, args, prompt: list[int]) -> dict:
    """Per-iteration op counts of one method (bs 1, greedy) on a fresh engine."""
    draft = draft_config(method, args.draft_dir)
    engine = st.Engine(target, draft=draft, max_batch_size=1,
                       max_seq_len=len(prompt) + args.new_tokens + 64)
    counter = OpCounter()
    instrument_engine(counter, engine)
    engine.generate([prompt], max_new_tokens=4, record=False, ignore_eos=True)  # warm the caches
    with patched(counter), counter:
        result = engine.generate([prompt], max_new_tokens=args.new_tokens, record=False, ignore_eos=True)
    iterations = result.stats.to_dict()["iterations"]
    table: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ops_by_row: dict[str, Counter] = defaultdict(Counter)
    syncs: dict[str, float] = defaultdict(float)
    for (path, op), n in counter.counts.items():
        where = row_of(path)
        if where is None:
            continue
        row, part = where
        table[row][part] += n / iterations
        ops_by_row[row][op] += n / iterations
        if op in SYNCS and row.startswith("graph"):
            syncs[row] += n / iterations
    return {"method": method, "iterations": iterations,
            "mean_accept_length": result.stats.to_dict()["mean_accept_length"],
            "rows": {r: dict(parts) for r, parts in table.items()},
            "totals": {r: sum(parts.values()) for r, parts in table.items()},
            "ops": {r: dict(c.most_common()) for r, c in ops_by_row.items()},
            "syncs_in_graphs": dict(syncs),
            "total": sum(sum(parts.values()) for parts in table.values())}


def print_tables(results: list[dict], top: int) -> None:
    print("\nspeculative.py --profile ops — kernel-launching aten ops per iteration "
          "(bs 1, GPU dispatch emulated on CPU)")
    for r in results:
        print(f"\n{r['method']}: {r['total']:.1f} ops/iteration over {r['iterations']} iterations "
              f"(accept {r['mean_accept_length']:.2f})")
        for row in sorted(r["rows"], key=lambda k: -r["totals"][k]):
            parts = r["rows"][row]
            split = ", ".join(f"{p} {n:.1f}" for p, n in sorted(parts.items(), key=lambda kv: -kv[1]))
            print(f"  {row:<34} {r['totals'][row]:>7.1f}   ({split})")
            if top:
                common = list(r["ops"][row].items())[:top]
                print(f"  {'':<34} {'':>7}    top ops: " + ", ".join(f"{op} {n:.1f}" for op, n in common))
        if r["syncs_in_graphs"]:
            print(f"  HOST SYNCS INSIDE GRAPHS: {r['syncs_in_graphs']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.set_defaults(device="cpu")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--workload", default="completion")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--top", type=int, default=6, help="most frequent ops to list per row (0: none)")
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("--profile ops counts on the CPU (it emulates the GPU's dispatch); use --device cpu")
    if args.quick:
        args.new_tokens = 6
    methods = args.methods.split(",")
    for m in methods:
        draft_config(m, args.draft_dir)  # bad names fail before any decoding
    target = load_target(args.model, "cpu")
    prompt = workload_prompts(target, args.prompts, args.workload, 1, 64 if args.quick else 256)[0]
    results = [count_method(target, m, args, prompt) for m in methods]
    print_tables(results, args.top)
    write_json("op_counts.json", {"meta": {**run_meta(args), "model": args.model, "workload": args.workload,
                                           "new_tokens": args.new_tokens}, "results": results}, args.out)
    return 0

