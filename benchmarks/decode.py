"""Plain (draft-free) greedy decode speed against the memory-bandwidth floor.

Figure: docs/BENCHMARKS.md "Plain decoding". Time: about 3 minutes on an H200 (--quick about 1).

    python benchmarks/decode.py            # 1B and 8B shapes, batch 1 and 8, 512 + 256 tokens
    python benchmarks/decode.py --quick    # ~1 minute: fewer tokens, transformers 16 tokens
    python benchmarks/decode.py --shapes tiny --device cpu --quick   # smoke test without a GPU
    python benchmarks/decode.py --shapes 8B --batches 1 --no-hf --deterministic   # deterministic mode's cost
    python benchmarks/decode.py --shapes 8B --tp 2 --quick     # split over 2 GPUs, and TP 1 on one GPU
    python benchmarks/decode.py --shapes 70B --tp 2 --no-tp1   # a target no one GPU holds
    python benchmarks/decode.py --shapes tiny --device cpu --quick --tp 2   # smoke test: 2 processes, gloo

Random bf16 weights built from a config (no download). For each shape and batch:
tokens/s of spectool eager, spectool with CUDA graphs (GraphRunner over one decode
step: forward + final norm + lm_head + argmax), transformers ``generate`` (default and
static cache; "n/a" if transformers is missing), the floor = copy bandwidth / bytes of
weights read per step (batch x that for tokens/s), and peak GPU memory. With
``--deterministic`` also the same graphs in deterministic mode (batch-invariant kernels,
docs/INTERNALS.md) and its rate as a share of the default mode's in the same run. Prints a
table; writes JSON to $OUT/decode.json (or --out DIR). ``--profile kernels`` lists a graphed
decode step's kernels instead (benchmarks/profiling/decode_kernels.py).

``--tp N`` splits the target over N processes (one GPU each; gloo on the CPU), started by the
script as ``spectool record --tp`` does (or run it under ``torchrun --nproc-per-node N``, which
reports the split run alone). Its floor is TP-N's: every GPU reads its 1/N of the weights per
step at its copy bandwidth (the all-reduces' time is not in it). After the split run the script
times the same shapes whole on one device (TP 1) unless ``--no-tp1``, and prints TP-N / TP-1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from profiling import profile_help, run_profile

from spectool.cli.launch import launch, launched
from spectool.graphs import GraphRunner
from spectool.kernels import ops, pdl
from spectool.kernels.fused import argmax_reference, argmax_triton
from spectool.model import parallel
from spectool.model.config import ModelConfig
from spectool.model.draft_layer import DraftModel, save_draft
from spectool.model.kv_cache import KVCache
from spectool.model.llama import Transformer
from spectool.model.parallel import TensorParallel

SHAPES = {
    "1B": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
               vocab_size=128256, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
               vocab_size=128256, tie_word_embeddings=False),
    # benchmarks/train_large_target.py's trained targets: --shape wide, deep.
    "107M": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                 vocab_size=4096, tie_word_embeddings=False),
    "113M": dict(hidden_size=512, num_layers=32, num_heads=8, num_kv_heads=2, intermediate_size=1792,
                 vocab_size=4096, tie_word_embeddings=False),
    "70B": dict(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, intermediate_size=28672,
                vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                 vocab_size=1000, tie_word_embeddings=True),
}


def model_config(shape: str, max_pos: int) -> ModelConfig:
    s = SHAPES[shape]
    return ModelConfig(head_dim=s["hidden_size"] // s["num_heads"], rope_theta=500000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=max_pos, **s)


def random_target(shape: str, device: str, max_pos: int):
    """A Target (spectool.load's type) of one of SHAPES with random weights and no tokenizer:
    float32 on CPU, bf16 on CUDA, seeded."""
    from spectool.model.loader import Target

    cfg = model_config(shape, max_pos)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(dtype).eval().requires_grad_(False)
    return Target(model=model, config=cfg, tokenizer=None, device=torch.device(device), dtype=dtype,
                  name=f"random-{shape}", model_hash="random", eos_token_ids=[])


def random_drafts(target, root: Path) -> Path:
    """Random EAGLE (1 layer) and multi-layer EAGLE (4 layers, chained as ``spectool train-draft``
    trains them by default, so every layer but the last runs over the whole prompt) checkpoints
    fitting ``target``."""
    torch.manual_seed(1)
    for kind, layers in (("eagle", 1), ("multi_layer_eagle", 4)):
        draft = DraftModel(target.config, layers, kind, chained=kind == "multi_layer_eagle")
        save_draft(draft.to(target.dtype), root / kind)
    return root


def random_model(cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel | None = None) -> Transformer:
    """``Transformer(cfg, tp)`` (on the current device) with its default random init made in
    ``dtype`` directly: a float32 copy first would not fit a GPU for a 70B shard."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return Transformer(cfg, tp).eval()
    finally:
        torch.set_default_dtype(old)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), best of a few."""
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def weight_bytes_per_step(model: Transformer) -> int:
    """Bytes of weights a decode step reads: every parameter once, but not the embedding table
    unless it doubles as the lm_head (a step reads only B rows of it)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def spectool_decode(model: Transformer, cache: KVCache, prompt: torch.Tensor, new_tokens: int,
                    graphs: bool, deterministic: bool = False) -> tuple[float, torch.Tensor, dict]:
    """Prefill, then ``new_tokens`` greedy steps; returns (decode seconds, generated tokens, the
    graph captures and, with ``graphs``, eager steps inside the timed loop: both must be 0).
    ``deterministic``: every forward (the prefill too) with deterministic mode's kernels. A split
    model (``model.tp``) takes the argmax from the ranks' vocabulary slices, as the engine does."""
    B, L = prompt.shape
    device = prompt.device
    slots = torch.arange(B, device=device)
    argmax = argmax_triton if device.type == "cuda" else argmax_reference
    if model.tp is not None:
        argmax = model.tp.argmax

    def step(tokens, positions, slots, starts):
        hidden = model(tokens, positions, cache=cache, slots=slots, starts=starts, deterministic=deterministic)
        return argmax(model.logits(hidden, deterministic=deterministic, gather=False)[:, -1])

    runner = GraphRunner(step, buckets=(1, 2, 4, 8), enabled=graphs)
    with torch.inference_mode():
        positions = torch.arange(L, device=device).expand(B, L)
        zeros = torch.zeros(B, dtype=torch.long, device=device)
        hidden = model(prompt, positions, cache=cache, slots=slots, starts=zeros, kv_len=L,
                       deterministic=deterministic)
        token = argmax(model.logits(hidden[:, -1:], deterministic=deterministic, gather=False)[:, -1])
        starts = torch.full((B,), L, dtype=torch.long, device=device)
        # Capture (or warm up) outside the timed loop, on a copy of the first step's inputs.
        runner.capture(B, tokens=token[:, None], positions=starts[:, None], slots=slots, starts=starts)
        out = [token]
        before = dict(runner.stats)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = runner(B, tokens=token[:, None], positions=starts[:, None], slots=slots, starts=starts)
            token = token.clone()  # the graph's output buffer is overwritten by the next replay
            starts += 1
            out.append(token)
        sync(device)
        elapsed = time.perf_counter() - t0
    faults = {"timed_graph_captures": runner.stats["captures"] - before["captures"],
              "timed_eager_steps": runner.stats["eager"] - before["eager"] if graphs else 0}
    return elapsed / max(1, new_tokens - 1) * new_tokens, torch.stack(out, 1), faults


def transformers_decode(shape: str, batch: int, prompt_len: int, new_tokens: int, device: torch.device,
                        static: bool) -> float | None:
    """tokens/s of transformers greedy generate on a same-shaped random model, or None if unavailable."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    s = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
                      num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                      intermediate_size=s["intermediate_size"], vocab_size=s["vocab_size"],
                      tie_word_embeddings=s["tie_word_embeddings"], rope_theta=500000.0,
                      max_position_embeddings=prompt_len + new_tokens + 16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    prompt = torch.randint(0, s["vocab_size"], (batch, prompt_len), device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    try:
        with torch.inference_mode():
            # Warm-up. A static cache compiles the decode step on first use, so its warm-up is a full run.
            model.generate(prompt, **(kwargs if static else {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}))
            sync(device)
            t0 = time.perf_counter()
            model.generate(prompt, **kwargs)
            sync(device)
            return batch * new_tokens / (time.perf_counter() - t0)
    except Exception as e:  # a transformers version without a feature: report, don't abort the run
        print(f"transformers ({'static' if static else 'default'} cache) failed: {e!r}")
        return None
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def switched(module, name: str, value) -> Iterator[None]:
    """``module.name = value`` inside the block, restored after it (also when it raises)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def variant(on: bool, model: Transformer, cache: KVCache, prompt: torch.Tensor, new_tokens: int, graphed: bool,
            faults: dict, switch: tuple | None = None, **kw) -> tuple[float | None, torch.Tensor | None]:
    """If ``on``, the same graphs again with ``module.name = value`` (``switch``) while they run:
    ``spectool_decode``'s seconds and tokens, its faults added to ``faults``; else (None, None)."""
    if not on:
        return None, None
    with switched(*switch) if switch else contextlib.nullcontext():
        seconds, tokens, more = spectool_decode(model, cache, prompt, new_tokens, graphs=graphed, **kw)
    for k, v in more.items():
        faults[k] += v
    return seconds, tokens


def run_shape(shape: str, batches: list[int], prompt_len: int, new_tokens: int, hf_tokens: int,
              device: torch.device, bandwidth: float, with_hf: bool, unfused: bool = False,
              deterministic: bool = False, tp: TensorParallel | None = None, no_pdl: bool = False,
              no_rope_fusion: bool = False, no_split_gemv: bool = False) -> list[dict]:
    """The rows of one shape; under ``tp`` this rank's shard of it (same seed on every rank, so the
    prompts agree) and the TP-N floor of one GPU reading its shard."""
    torch.manual_seed(0)
    cfg = model_config(shape, prompt_len + new_tokens + 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = random_model(cfg, dtype, tp)
    wbytes = weight_bytes_per_step(model)
    rows = []
    for batch in batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        cache = KVCache.for_model(model.local_config, batch, prompt_len + new_tokens + 64, dtype, device)
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
        graphed = device.type == "cuda"
        eager_s, eager_tokens, _ = spectool_decode(model, cache, prompt, new_tokens, graphs=False)
        graph_s, graph_tokens, faults = spectool_decode(model, cache, prompt, new_tokens, graphs=graphed)
        run = (model, cache, prompt, new_tokens, graphed, faults)
        # Without the fused one-row GEMVs (kernels/gemv.py); with every kernel launched without PDL
        # (kernels/pdl.py); with RoPE in its own kernel before the attention; in deterministic mode.
        unfused_s, _ = variant(unfused, *run, switch=(ops, "FUSED_GEMV", False))
        no_pdl_s, no_pdl_tokens = variant(no_pdl, *run, switch=(pdl, "ENABLED", False))
        no_rope_s, no_rope_tokens = variant(no_rope_fusion, *run, switch=(ops, "FUSED_ROPE_ATTENTION", False))
        # Several sequences' projections through cuBLAS instead of the split-K kernel (batches above 1).
        no_split_s, no_split_tokens = variant(no_split_gemv and batch > 1, *run, switch=(ops, "SPLIT_GEMV", False))
        det_s, _ = variant(deterministic, *run, deterministic=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        del cache
        row = {
            "shape": shape, "tp": 1 if tp is None else tp.size, "batch": batch, "prompt": prompt_len,
            "new_tokens": new_tokens, "weight_gb": wbytes / 1e9, "copy_tb_s": bandwidth / 1e12,
            "floor_tok_s": batch * bandwidth / wbytes,
            "spectool_eager_tok_s": batch * new_tokens / eager_s,
            "spectool_graphs_tok_s": batch * new_tokens / graph_s,
            "spectool_graphs_unfused_tok_s": None if unfused_s is None else batch * new_tokens / unfused_s,
            "spectool_graphs_deterministic_tok_s": None if det_s is None else batch * new_tokens / det_s,
            "spectool_graphs_no_pdl_tok_s": None if no_pdl_s is None else batch * new_tokens / no_pdl_s,
            "pdl_vs_no_pdl": None if no_pdl_s is None else no_pdl_s / graph_s,
            "no_pdl_same_tokens": None if no_pdl_s is None else bool(torch.equal(no_pdl_tokens, graph_tokens)),
            "spectool_graphs_no_rope_fusion_tok_s": None if no_rope_s is None else batch * new_tokens / no_rope_s,
            "rope_fusion_gain": None if no_rope_s is None else no_rope_s / graph_s,
            "no_rope_fusion_same_tokens": (None if no_rope_s is None
                                           else bool(torch.equal(no_rope_tokens, graph_tokens))),
            "spectool_graphs_no_split_gemv_tok_s": None if no_split_s is None else batch * new_tokens / no_split_s,
            "split_gemv_gain": None if no_split_s is None else no_split_s / graph_s,
            "no_split_gemv_same_tokens": (None if no_split_s is None
                                          else bool(torch.equal(no_split_tokens, graph_tokens))),
            "deterministic_vs_default": None if det_s is None else graph_s / det_s,
            "eager_graph_same_tokens": bool(torch.equal(eager_tokens, graph_tokens)),
            "peak_gpu_gb": peak, **faults,
        }
        # A capture or an eager step inside the timed loop would make the graphed figure a mix: refused.
        row["refused"] = bool(faults["timed_graph_captures"] or faults["timed_eager_steps"])
        if row["refused"]:
            row["spectool_graphs_tok_s"] = row["spectool_graphs_unfused_tok_s"] = None
            row["spectool_graphs_deterministic_tok_s"] = row["deterministic_vs_default"] = None
            row["spectool_graphs_no_pdl_tok_s"] = row["pdl_vs_no_pdl"] = None
            row["spectool_graphs_no_rope_fusion_tok_s"] = row["rope_fusion_gain"] = None
            row["spectool_graphs_no_split_gemv_tok_s"] = row["split_gemv_gain"] = None
        row["graphs_pct_floor"] = (None if row["refused"]
                                   else 100 * row["spectool_graphs_tok_s"] / row["floor_tok_s"])
        rows.append(row)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for row in rows:  # transformers after spectool's weights are freed
        for static in (False, True):
            key = "hf_static_tok_s" if static else "hf_default_tok_s"
            row[key] = (transformers_decode(shape, row["batch"], prompt_len, hf_tokens, device, static)
                        if with_hf else None)
    return rows


def fmt(v, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


ROWS_ENV = "SPECTOOL_DECODE_ROWS"  # where rank 0 of a split run leaves its rows for the launching process


def measure(args: argparse.Namespace, device: torch.device, tp: TensorParallel | None) -> list[dict]:
    """Every (shape, batch) row of this process (one rank's view under ``tp``)."""
    new_tokens = 64 if args.quick else args.new_tokens
    hf_tokens = args.hf_tokens or (16 if args.quick else args.new_tokens)
    bandwidth = copy_bandwidth(device)
    rows = []
    for shape in args.shapes.split(","):
        batches = [int(b) for b in args.batches.split(",")]
        rows += run_shape(shape, batches, args.prompt, new_tokens, hf_tokens, device, bandwidth,
                          with_hf=not args.no_hf and tp is None, unfused=args.unfused,
                          deterministic=args.deterministic, tp=tp, no_pdl=args.no_pdl,
                          no_rope_fusion=args.no_rope_fusion, no_split_gemv=args.no_split_gemv)
    return rows


def report(rows: list[dict], args: argparse.Namespace, device: torch.device, argv: list[str]) -> None:
    """The table (and TP-N / TP-1 where both ran), and $OUT/decode.json."""
    head = (f"{'shape':>5} {'tp':>2} {'B':>2} {'floor':>7} {'eager':>7} {'graphs':>7} {'%floor':>6} {'hf':>6} "
            f"{'hf-stat':>7} {'same':>5} {'peakGB':>6}")
    bandwidth = rows[0]["copy_tb_s"] if rows else 0.0
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"copy bandwidth {bandwidth:.2f} TB/s per device; tokens/s, batch 1 and 8 count all rows; "
          f"floor at TP N = each device reading its 1/N of the weights; "
          f"a row whose timed graphed loop captured a graph or ran a step eagerly is refused")
    print(head)
    for r in rows:
        if r["refused"]:
            print(f"{r['shape']:>5} {r['tp']:>2} {r['batch']:>2} refused: {r['timed_graph_captures']} graph captures "
                  f"and {r['timed_eager_steps']} eager steps inside the timed loop")
            continue
        print(f"{r['shape']:>5} {r['tp']:>2} {r['batch']:>2} {r['floor_tok_s']:7.0f} {r['spectool_eager_tok_s']:7.0f} "
              f"{r['spectool_graphs_tok_s']:7.0f} {r['graphs_pct_floor']:6.1f} "
              f"{fmt(r['hf_default_tok_s']):>6} {fmt(r['hf_static_tok_s']):>7} "
              f"{str(r['eager_graph_same_tokens']):>5} {fmt(r['peak_gpu_gb'], '.1f'):>6}"
              + (f"  unfused graphs {r['spectool_graphs_unfused_tok_s']:.0f}" if args.unfused else "")
              + (f"  without PDL {r['spectool_graphs_no_pdl_tok_s']:.0f} (PDL {r['pdl_vs_no_pdl']:.3f}x, "
                 f"same tokens {r['no_pdl_same_tokens']})" if args.no_pdl else "")
              + (f"  RoPE apart {r['spectool_graphs_no_rope_fusion_tok_s']:.0f} (fused {r['rope_fusion_gain']:.3f}x, "
                 f"same tokens {r['no_rope_fusion_same_tokens']})" if args.no_rope_fusion else "")
              + (f"  cuBLAS {r['spectool_graphs_no_split_gemv_tok_s']:.0f} (split-K {r['split_gemv_gain']:.3f}x, "
                 f"same tokens {r['no_split_gemv_same_tokens']})" if r.get("split_gemv_gain") else "")
              + (f"  deterministic graphs {r['spectool_graphs_deterministic_tok_s']:.0f} "
                 f"({100 * r['deterministic_vs_default']:.1f} % of default)" if args.deterministic else ""))
    whole = {(r["shape"], r["batch"]): r for r in rows if r["tp"] == 1 and not r["refused"]}
    for r in rows:
        base = whole.get((r["shape"], r["batch"]))
        if r["tp"] > 1 and base is not None and not r["refused"]:
            r["vs_tp1"] = r["spectool_graphs_tok_s"] / base["spectool_graphs_tok_s"]
            print(f"{r['shape']} batch {r['batch']}: TP {r['tp']} / TP 1 = {r['vs_tp1']:.2f}x tokens/s")
    folder = args.out or os.environ.get("OUT")
    if folder:
        from speculative import provenance  # here: speculative.py imports this module

        meta = {"torch": torch.__version__, "device": str(device), "quick": args.quick, "tp": args.tp,
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                **provenance("decode", argv, args.device)}
        with open(os.path.join(folder, "decode.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = run_profile("decode", argv)
    if code is not None:
        return code
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", metavar="KIND", help=profile_help("decode"))
    ap.add_argument("--shapes", default="1B,8B")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="64 new tokens, transformers 16")
    ap.add_argument("--hf-tokens", type=int, default=None,
                    help="new tokens for transformers generate (default: as spectool; its rate is per token)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--unfused", action="store_true",
                    help="also time the graphs without the fused one-row GEMVs (kernels/gemv.py)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="also time the same graphs with every kernel launched without programmatic dependent "
                         "launch (spectool/kernels/pdl.py), and PDL's gain")
    ap.add_argument("--no-rope-fusion", action="store_true",
                    help="also time the same graphs with RoPE and the cache write in their own kernel before the "
                         "attention (spectool/kernels/attention_triton.py takes them in a decode step), and the gain")
    ap.add_argument("--no-split-gemv", action="store_true",
                    help="also time the same graphs with several sequences' projections through cuBLAS instead of "
                         "the split-K kernel (spectool/kernels/gemv_split.py), and the gain (batches above 1)")
    ap.add_argument("--deterministic", action="store_true",
                    help="also time the graphs in deterministic mode (batch-invariant kernels)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="directory for the JSON (default: $OUT)")
    ap.add_argument("--tp", type=int, default=1,
                    help="split the target over this many processes (one GPU each; gloo on the CPU)")
    ap.add_argument("--no-tp1", action="store_true",
                    help="with --tp: skip the TP 1 run on one device (a target that does not fit one)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.tp > 1 and not launched():  # start the ranks, collect rank 0's rows, then TP 1 here
        with tempfile.TemporaryDirectory() as tmp:
            rows_file = os.path.join(tmp, "rows.json")
            os.environ[ROWS_ENV] = rows_file
            code = launch([sys.executable, os.path.abspath(__file__), *argv], args.tp)
            if code != 0:
                return code
            with open(rows_file) as f:
                rows = json.load(f)
        if not args.no_tp1:
            rows += measure(args, device, None)
        report(rows, args, device, argv)
        return 0
    tp = None
    if args.tp > 1:
        tp = parallel.init(args.tp, device)
        device = parallel.local_device(device, tp)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    rows = measure(args, device, tp)
    if tp is not None and tp.rank != 0:
        return 0
    if tp is not None and os.environ.get(ROWS_ENV):
        with open(os.environ[ROWS_ENV], "w") as f:
            json.dump(rows, f)
        return 0
    report(rows, args, device, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
