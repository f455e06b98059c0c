"""benchmarks/headline.py rewrites the headline table of docs/BENCHMARKS.md from the benchmarks' JSON:
run here on small synthetic JSON against a copy of the real document."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from spectool.kernels.verify_sampling_chunked import default_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "BENCHMARKS.md"
ENGINE_SHAPE = default_config(16)  # the chunked sampling verify's launch shape for one tree of 16 nodes


@pytest.fixture(scope="module")
def headline():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("headline")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def meta(command: str, date: str = "2031-02-03 04:05:06", machine: str = "Test GPU 80GB") -> dict:
    return {"date": date, "machine": machine, "command": command}


def table(text: str, headline) -> list[list[str]]:
    """The headline table's rows as cells, read straight from the text."""
    lines = text.splitlines()
    body = lines[lines.index(headline.BEGIN) + 1:lines.index(headline.END)]
    assert body[0] == "| area | figure | value | machine | date | command |"
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in body[2:]]


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, Path]:
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(DOC, doc)
    out = tmp_path / "out"
    (out / "large").mkdir(parents=True)
    decode = {"meta": meta("python3 benchmarks/decode.py --shapes 8B --batches 1"), "rows": [
        {"shape": "8B", "batch": 1, "refused": None, "spectool_graphs_tok_s": 250.4, "graphs_pct_floor": 88.04,
         "deterministic_vs_default": 0.9871, "spectool_graphs_deterministic_tok_s": 247.2},
        {"shape": "1B", "batch": 8, "refused": "2 graph captures", "spectool_graphs_tok_s": None}]}
    cells = [("plain", 1, 0.0, 1000.0, 400.0, 0.0), ("eagle", 1, 0.0, 3000.0, 1000.0, 3.25),
             ("eagle", 1, 1.0, 2000.0, 900.0, 1.5), ("eagle", 4, 0.0, 9000.0, 4000.0, 3.0),
             ("plain", 4, 0.0, 3500.0, 2000.0, 0.0)]
    rows = []
    for method, batch, temp, decode_tps, e2e_tps, accept in cells:
        base = next(c for c in cells if c[0] == "plain" and c[1] == batch)
        rows.append({"method": method, "workload": "completion", "batch": batch, "temperature": temp,
                     "refused": None, "tokens_per_s": decode_tps, "end_to_end_tokens_per_s": e2e_tps,
                     "mean_accept_length": accept, "speedup": decode_tps / base[3],
                     "end_to_end_speedup": e2e_tps / base[4]})
    spec = {"meta": meta("python3 benchmarks/speculative.py --model /t --batches 1,4"), "rows": rows}
    (out / "decode.json").write_text(json.dumps(decode))
    (out / "large" / "speculative.json").write_text(json.dumps(spec))
    return doc, out


def test_the_table_is_rewritten_from_the_json_and_keeps_the_other_rows(headline, inputs):
    doc, out = inputs
    before = table(doc.read_text(), headline)
    assert before, "docs/BENCHMARKS.md has a headline table"
    assert headline.main(["--json", str(out), "--doc", str(doc)]) == 0
    after = table(doc.read_text(), headline)
    by_key = {(r[0], r[1]): r for r in after}
    cmd = "`python3 benchmarks/decode.py --shapes 8B --batches 1`"
    assert by_key["Plain decoding", "Llama-3-8B shape, bs 1, CUDA graphs"] == [
        "Plain decoding", "Llama-3-8B shape, bs 1, CUDA graphs", "250 tok/s, 88.0 % of the bandwidth floor",
        "Test GPU 80GB", "2031-02-03", cmd]
    assert by_key["Plain decoding", "Llama-3-8B shape, bs 1, CUDA graphs, deterministic mode"][2] == (
        "247 tok/s, 98.7 % of the default mode")
    assert not any("Llama-3.2-1B shape, bs 8" in r[1] and r[4] == "2031-02-03" for r in after)  # refused: no row
    # Speculative: the smallest batch, greedy only; 3000 / 1000 decode, 1000 / 400 end to end.
    spec = [r for r in after if r[0] == "Speculative decoding, 113M target"]
    assert [r[1:3] for r in spec if r[4] == "2031-02-03"] == [
        ["EAGLE, completion, bs 1", "3.00× decode-only, 2.50× end to end (accept 3.25)"]]
    # Every row no file yields is as it was, in its place among its area's.
    fresh = {k for k, r in by_key.items() if r[4] == "2031-02-03"}
    assert [r for r in after if (r[0], r[1]) not in fresh] == [r for r in before if (r[0], r[1]) not in fresh]
    areas = [r[0] for r in after]
    assert areas == sorted(areas, key=lambda a: [s[1] for s in headline.SOURCES].index(a)
                           if a in [s[1] for s in headline.SOURCES] else len(headline.SOURCES))
    # Everything outside the markers is untouched, and a second run changes nothing.
    text, original = doc.read_text(), DOC.read_text()
    assert text.split(headline.BEGIN)[0] == original.split(headline.BEGIN)[0]
    assert text.split(headline.END)[1] == original.split(headline.END)[1]
    assert headline.main(["--json", str(out), "--doc", str(doc), "--check"]) == 0
    assert headline.main(["--json", str(out), "--doc", str(DOC), "--check"]) == 1  # the real one is older


def test_the_document_is_in_the_form_the_script_writes(headline, tmp_path):
    """With no JSON the table is re-rendered from itself: equal text means hand edits kept its form."""
    assert headline.main(["--json", str(tmp_path), "--doc", str(DOC), "--check"]) == 0


def test_a_file_without_provenance_or_a_document_without_markers_is_refused(headline, inputs, capsys):
    doc, out = inputs
    data = json.loads((out / "decode.json").read_text())
    del data["meta"]["command"]
    (out / "decode.json").write_text(json.dumps(data))
    text = doc.read_text()
    assert headline.main(["--json", str(out), "--doc", str(doc)]) == 2
    assert "lacks command" in capsys.readouterr().err and doc.read_text() == text
    (out / "decode.json").unlink()
    doc.write_text(text.replace(headline.END, ""))
    assert headline.main(["--json", str(out), "--doc", str(doc)]) == 2
    assert headline.main(["--json", str(out / "missing"), "--doc", str(doc)]) == 2


def test_every_source_yields_its_rows(headline, tmp_path):
    """Recording, kernels, N-gram corpus and views: one JSON each, shaped as their scripts write them."""
    nan = float("nan")
    files = {
        "recording_8B.json": {"engine": [
            {"method": "none", "batch": 1, "shape": "8B", "ratio": 0.97, "tokens_per_s_on": 219.4,
             "tokens_per_s_off": 226.2},
            {"method": "eagle", "batch": 1, "shape": "8B", "refused": "1 graph captures"}]},
        "tree_kernels.json": {"index": [{"bs": 1, "N": 16, "triton_us": 4.62, "speedup": 60.44},
                                        {"bs": 1, "N": 8, "triton_us": 4.0, "speedup": 50.0},
                                        {"bs": 64, "N": 64, "triton_us": nan, "speedup": nan}],
                              "verify": [{"bs": 1, "N": 16, "greedy_graphed_us": 13.94, "sampling_graphed_us": nan}],
                              "sampling": [{"dtype": "float32", "bs": 1, "N": 16, "top_k": 0, "top_p": 1.0,
                                            "cuts": "temperature", "config": ENGINE_SHAPE, "torch_graphed_us": 338.4,
                                            "chunked_graphed_us": 56.4},
                                           {"dtype": "float32", "bs": 1, "N": 16, "top_k": 0, "top_p": 0.9,
                                            "cuts": "top-p 0.9", "config": ENGINE_SHAPE, "torch_graphed_us": 330.0,
                                            "chunked_graphed_us": 1650.0},
                                           # Another launch shape than the engine's for these rows: not a headline.
                                           {"dtype": "float32", "bs": 1, "N": 16, "top_k": 0, "top_p": 1.0,
                                            "cuts": "temperature", "config": "c16384-p16-w16",
                                            "torch_graphed_us": 338.4, "chunked_graphed_us": 99.0},
                                           {"dtype": "bfloat16", "bs": 1, "N": 16, "top_k": 0, "top_p": 1.0,
                                            "cuts": "temperature", "config": ENGINE_SHAPE, "torch_graphed_us": 344.0,
                                            "chunked_graphed_us": 58.8}]},
        "gemv.json": {"rows": [{"shape": "8B", "projection": "o", "N": 4096, "K": 4096, "rows": 1,
                                "triton_default_us": 10.61, "unfused_us": 13.33},
                               {"shape": "8B", "projection": "o", "N": 4096, "K": 4096, "rows": 4,
                                "triton_default_us": 20.0, "unfused_us": 30.0}]},
        "ngram_corpus.json": {"matches": {"bfs": {"capacity": 10_000_000, "rows": [
            {"bs": 64, "total_us": 3.94, "speedup": 52.4}]}, "prob": {"capacity": 10_000_000, "rows": []}}},
        "ngram_vs_sglang.json": {"capacity": 10_000_000, "matches": {
            "bfs": {"rows": [{"bs": 8, "spectool": {"cpu_us": 8.6}, "sglang": {"cpu_us": 211.3}, "cpu_ratio": 24.6}]},
            "prob": {"rows": [{"bs": 8, "spectool": {"cpu_us": 1.0}, "sglang": {"cpu_us": 2.0}, "cpu_ratio": 2.0}]}},
            "memory": {"capacity": 10_000_000, "spectool": {"bytes_per_node": 53.3},
                       "sglang": {"bytes_per_node": 434.6}, "ratio": 8.15}},
        "widgets.json": {"iterations": 10000, "nodes": 64, "open_s_median": 2.104},
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps({"meta": meta(f"python3 benchmarks/{name[:-5]}.py"), **data}))
    rows = {(area, figure): value for name in files for area, figure, value, *_ in headline.source_rows(tmp_path)[name]}
    assert rows == {
        ("Recording", "plain, bs 1, Llama-3-8B shape"): "record on/off 0.970 (219 against 226 tok/s)",
        ("Kernels", "tree indices from the mask, bs 1, N 16"): "4.6 µs, 60.4× the torch reference",
        ("Kernels", "greedy verify in a CUDA graph, V 128256, bs 1, N 16"): "13.9 µs",
        ("Kernels", "chunked sampling verify in a CUDA graph, temperature, V 128256, bs 1, N 16"):
            "56.4 µs, 6.0× the torch verify",
        ("Kernels", "chunked sampling verify in a CUDA graph, top-p 0.9, V 128256, bs 1, N 16"):
            "1650.0 µs, 0.2× the torch verify",
        ("Kernels", "fused one-row GEMV, Llama-3-8B o 4096×4096"): "10.6 µs (cuBLAS and glue 13.3)",
        ("N-gram corpus", "get + put per request, bs 64, 10M-node trie"): "3.9 µs, 52× the Python reference",
        ("N-gram corpus", "get + put per request against SGLang's corpus, BFS, bs 8, 10M-node trie"):
            "8.6 µs CPU against SGLang's 211 µs (25×)",
        ("N-gram corpus", "memory against SGLang's corpus, 10M-node trie"): "53 against 435 bytes per node (8.2×)",
        ("Views", "TraceViewer's data for 10000 iterations"): "2.10 s",
    }
