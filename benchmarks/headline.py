"""Regenerate the headline table at the top of docs/BENCHMARKS.md from the benchmarks' JSON.

    python3 benchmarks/headline.py --json $OUT                 # after OUT=... bash benchmarks/run_gpu.sh
    python3 benchmarks/headline.py --json $OUT --doc docs/BENCHMARKS.md --check   # exit 1 if it would change

Figure: docs/BENCHMARKS.md "Headline figures". Time: under a second (it reads JSON, measures nothing).

Each JSON file that --json holds (SOURCES below names them) rewrites the rows it yields (a row is
its area and figure); the date, machine and command of every row come from that file's ``meta``
(written by the benchmark: benchmarks/speculative.py's ``provenance``). Rows no file yields are
kept as they are, each with its own date, so a run of a few parts updates only their rows. To add
rows: a function from a JSON file to (figure, value) pairs, and one SOURCES entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- headline:begin (benchmarks/headline.py writes the rows below; edit that, not them) -->"
END = "<!-- headline:end -->"
HEADER = ["area", "figure", "value", "machine", "date", "command"]

SHAPE_NAMES = {"8B": "Llama-3-8B", "1B": "Llama-3.2-1B"}
SHAPES_OF_RECORDING = {"demo": "demo model", "8B": "Llama-3-8B shape", "1B": "Llama-3.2-1B shape"}
METHOD_NAMES = {"none": "plain", "plain": "plain", "ngram": "N-gram", "eagle": "EAGLE", "eagle3": "EAGLE-3",
                "multi_layer_eagle": "multi-layer EAGLE"}

Rows = Iterator[tuple[str, str]]


def decode_rows(data: dict) -> Rows:
    for r in data["rows"]:
        if r.get("refused"):
            continue
        figure = f"{SHAPE_NAMES.get(r['shape'], r['shape'])} shape, bs {r['batch']}, CUDA graphs"
        yield figure, f"{r['spectool_graphs_tok_s']:.0f} tok/s, {r['graphs_pct_floor']:.1f} % of the bandwidth floor"
        if r.get("deterministic_vs_default") is not None:
            yield (f"{figure}, deterministic mode", f"{r['spectool_graphs_deterministic_tok_s']:.0f} tok/s, "
                   f"{100 * r['deterministic_vs_default']:.1f} % of the default mode")


def speculative_rows(data: dict) -> Rows:
    """Each method and workload at the run's smallest batch, greedy: its speedups over plain."""
    greedy = [r for r in data["rows"] if r["temperature"] == 0 and not r.get("refused")]
    if not greedy:
        return
    batch = min(r["batch"] for r in greedy)
    for r in greedy:
        if r["batch"] == batch and r["method"] != "plain" and r.get("speedup") is not None:
            yield (f"{METHOD_NAMES.get(r['method'], r['method'])}, {r['workload']}, bs {batch}",
                   f"{r['speedup']:.2f}× decode-only, {r['end_to_end_speedup']:.2f}× end to end "
                   f"(accept {r['mean_accept_length']:.2f})")


def recording_rows(data: dict) -> Rows:
    for r in data.get("engine", []):
        if "ratio" in r:
            shape = SHAPES_OF_RECORDING.get(r["shape"], r["shape"])
            yield (f"{METHOD_NAMES.get(r['method'], r['method'])}, bs {r['batch']}, {shape}",
                   f"record on/off {r['ratio']:.3f} ({r['tokens_per_s_on']:.0f} against "
                   f"{r['tokens_per_s_off']:.0f} tok/s)")



def tune_rows(data: dict) -> Rows:
    """Per draft method: how many of its points the tuner predicted within 10 % of the measured tokens/s."""
    rows = data["rows"]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        tps = [r["tokens_per_s_error"] for r in mine]
        acc = [r["accept_error"] for r in mine if r["accept_error"] is not None]
        sizes = ", ".join(str(b) for b in sorted({r["batch_size"] for r in mine}))
        yield (f"{METHOD_NAMES.get(method, method)}: predicted against measured, bs {sizes}",
               f"tokens/s within 10 % at {sum(abs(e) <= 0.10 for e in tps)} of {len(tps)} points "
               f"({min(tps):+.1%} to {max(tps):+.1%}); accept length {min(acc):+.1%} to {max(acc):+.1%}")


INDEX_CELLS = {(1, 16), (64, 64), (256, 64)}  # (bs, N): the engine's smallest tree, and large batches


def tree_kernel_rows(data: dict) -> Rows:
    from spectool.kernels.verify_sampling_chunked import default_config

    for r in data.get("index", []):
        if (r["bs"], r["N"]) in INDEX_CELLS and r["triton_us"] == r["triton_us"]:  # NaN: no Triton here
            yield (f"tree indices from the mask, bs {r['bs']}, N {r['N']}",
                   f"{r['triton_us']:.1f} µs, {r['speedup']:.1f}× the torch reference")
    for r in data["verify"]:
        for kind in ("greedy", "sampling"):
            us = r[f"{kind}_graphed_us"]
            if us == us:
                yield f"{kind} verify in a CUDA graph, V 128256, bs {r['bs']}, N {r['N']}", f"{us:.1f} µs"
    for r in data.get("sampling", []):  # the engine's chunked sampling verify, float32 logits as it runs them
        engine_shape = r["config"] == default_config(r["bs"] * r["N"])
        if r["dtype"] == "float32" and engine_shape and r["chunked_graphed_us"] == r["chunked_graphed_us"]:
            yield (f"chunked sampling verify in a CUDA graph, {r['cuts']}, V 128256, bs {r['bs']}, N {r['N']}",
                   f"{r['chunked_graphed_us']:.1f} µs, {r['torch_graphed_us'] / r['chunked_graphed_us']:.1f}× "
                   "the torch verify")


def gemv_rows(data: dict) -> Rows:
    for r in data["rows"]:
        if r["rows"] == 1 and r.get("triton_default_us") is not None:
            yield (f"fused one-row GEMV, {SHAPE_NAMES.get(r['shape'], r['shape'])} {r['projection']} "
                   f"{r['N']}×{r['K']}", f"{r['triton_default_us']:.1f} µs (cuBLAS and glue {r['unfused_us']:.1f})")


def ngram_rows(data: dict) -> Rows:
    run = data["matches"]["bfs"] if "matches" in data else data
    for r in run["rows"]:
        yield (f"get + put per request, bs {r['bs']}, {run['capacity'] / 1e6:g}M-node trie",
               f"{r['total_us']:.1f} µs, {r['speedup']:.0f}× the Python reference")


def ngram_sglang_rows(data: dict) -> Rows:
    """BFS get + put per request, in CPU time (the worker threads' included), and memory per node."""
    run = data["matches"].get("bfs") or next(iter(data["matches"].values()))
    for r in run["rows"]:
        yield (f"get + put per request against SGLang's corpus, BFS, bs {r['bs']}, "
               f"{data['capacity'] / 1e6:g}M-node trie",
               f"{r['spectool']['cpu_us']:.1f} µs CPU against SGLang's {r['sglang']['cpu_us']:.0f} µs "
               f"({r['cpu_ratio']:.0f}×)")
    memory = data.get("memory")
    if memory:
        yield (f"memory against SGLang's corpus, {memory['capacity'] / 1e6:g}M-node trie",
               f"{memory['spectool']['bytes_per_node']:.0f} against {memory['sglang']['bytes_per_node']:.0f} bytes "
               f"per node ({memory['ratio']:.1f}×)")


def widgets_rows(data: dict) -> Rows:
    yield f"TraceViewer's data for {data['iterations']} iterations", f"{data['open_s_median']:.2f} s"
    viewer = data.get("viewer_page") or {}  # measured in headless Chromium, where it is installed
    if viewer:
        yield (f"TraceViewer of {data['iterations']} iterations: page mount to the first tree",
               f"{viewer['mount_s']:.2f} s")
        yield f"TraceViewer: one step of a {data['nodes']}-node tree", f"{viewer['step_ms_median']:.0f} ms (median)"
    page = data.get("report_page") or {}
    if page:
        yield (f"report of {data['iterations']} iterations: open to the first tree", f"{page['page_open_s']:.1f} s")
        yield f"report: one step of a {data['nodes']}-node tree", f"{page['step_ms_median']:.0f} ms (median)"
    big = data.get("big") or {}
    if big:
        mount = f" + {big['page_mount_s']:.2f} s in the page" if "page_mount_s" in big else ""
        yield f"TraceViewer of {big['records']:,} records: open", f"{big['open_s']:.2f} s in the kernel{mount}"


# (JSON file under --json, area, rows): the table lists the areas in this order.
SOURCES: list[tuple[str, str, Callable[[dict], Rows]]] = [
    ("decode.json", "Plain decoding", decode_rows),
    ("large/speculative.json", "Speculative decoding, 113M target", speculative_rows),
    ("speculative.json", "Speculative decoding, demo model", speculative_rows),
    ("recording_8B.json", "Recording", recording_rows),
    ("recording.json", "Recording", recording_rows),
    ("large/tune_accuracy.json", "What-if tuner, 113M target", tune_rows),
    ("tree_kernels.json", "Kernels", tree_kernel_rows),
    ("gemv.json", "Kernels", gemv_rows),
    ("ngram_corpus.json", "N-gram corpus", ngram_rows),
    ("ngram_vs_sglang.json", "N-gram corpus", ngram_sglang_rows),
    ("widgets.json", "Views", widgets_rows),
]


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def source_rows(folder: Path) -> dict[str, list[list[str]]]:
    """Per JSON file found in ``folder``: its table rows, provenance from its meta."""
    found = {}
    for name, area, rows in SOURCES:
        path = folder / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        meta = data.get("meta") or {}
        missing = [k for k in ("date", "machine", "command") if not meta.get(k)]
        if missing:
            raise ValueError(f"{path}: its meta lacks {', '.join(missing)} (re-run the benchmark that wrote it)")
        found[name] = [[area, figure, value, meta["machine"], meta["date"][:10], f"`{meta['command']}`"]
                       for figure, value in rows(data)]
    return found


def parse_table(lines: list[str]) -> list[list[str]]:
    """The rows of the markdown table between the markers (header and rule left out)."""
    rows = []
    for line in lines:
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if cells != HEADER:
                rows.append(cells)
    return rows


def merge(old: list[list[str]], new: dict[str, list[list[str]]]) -> list[list[str]]:
    """A new row replaces the old row of the same area and figure, in place; the other new rows follow
    their area's; old rows no new file speaks of stay (each names its own date). Areas in SOURCES
    order, then any others in their first order."""
    rows = [list(row) for row in old]
    at = {(row[0], row[1]): i for i, row in enumerate(rows)}
    for row in (row for fresh in new.values() for row in fresh):
        if (row[0], row[1]) in at:
            rows[at[row[0], row[1]]] = row
        else:
            at[row[0], row[1]] = len(rows)
            rows.append(row)
    order = list(dict.fromkeys([area for _, area, _ in SOURCES] + [row[0] for row in rows]))
    return sorted(rows, key=lambda row: order.index(row[0]))


def render(rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
            + ["| " + " | ".join(cell(c) if i < 5 else c for i, c in enumerate(row)) + " |" for row in rows])


def regenerate(doc: str, folder: Path) -> str:
    """``doc`` with its headline table rewritten from the JSON files in ``folder``."""
    lines = doc.splitlines()
    if lines.count(BEGIN) != 1 or lines.count(END) != 1 or lines.index(BEGIN) > lines.index(END):
        raise ValueError(f"the document needs one {BEGIN!r} line and, after it, one {END!r} line")
    begin, end = lines.index(BEGIN), lines.index(END)
    rows = merge(parse_table(lines[begin + 1:end]), source_rows(folder))
    return "\n".join(lines[:begin + 1] + render(rows) + lines[end:]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="folder of the benchmarks' JSON (run_gpu.sh's $OUT)")
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="the document to rewrite")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the table is out of date")
    args = p.parse_args(argv)
    folder, doc = Path(args.json), Path(args.doc)
    if not folder.is_dir() or not doc.is_file():
        print(f"headline.py: no folder {folder} or no document {doc}", file=sys.stderr)
        return 2
    try:
        text = regenerate(doc.read_text(encoding="utf-8"), folder)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"headline.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.check:
        return int(text != doc.read_text(encoding="utf-8"))
    doc.write_text(text, encoding="utf-8")
    print(f"rewrote the headline table of {doc} from {sorted(n for n, _, _ in SOURCES if (folder / n).is_file())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
