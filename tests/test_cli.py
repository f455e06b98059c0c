"""The `spectool` command line: record → check / summary / report / export-perfetto, demo, bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trace_factory import make_trace

from spectool.cli import COMMANDS, main
from spectool.prompts import load_prompts
from spectool.trace.reader import Trace

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None) -> tuple[int, str, str, list[str]]:
    """``spectool ARGS`` in a fresh interpreter: exit code, stdout, stderr and the heavy modules it imported."""
    code = ("import sys\nfrom spectool.cli import main\nrc = main(sys.argv[1:])\n"
            "print('IMPORTED', [m for m in ('torch', 'triton', 'plotly') if m in sys.modules], file=sys.stderr)\n"
            "sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)
    err, _, imported = p.stderr.rpartition("IMPORTED ")
    return p.returncode, p.stdout, err, eval(imported)  # the list printed above


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, demo_model_dir):
    # Short held-out prompts keep the CPU runs quick.
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"kind": "completion", "prompt": p[:300]} for p in load_prompts(demo_model_dir / "prompts.jsonl")[:2]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_help_and_unknown_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_is_for_users_and_needs_no_torch(command):
    rc, out, err, imported = run_cli(command, "--help")
    assert rc == 0, err
    assert out.startswith(f"usage: spectool {command}")
    assert imported == []  # answered before torch (or plotly) loads
    # Written for users: no docstring fragments or RST markup, and defaults are shown.
    assert "``" not in out and "Raises" not in out and "TraceFormatError" not in out
    if command in ("demo", "record", "bench", "train-target", "train-draft"):
        assert "(default: " in out


def test_bad_numbers_are_refused_before_the_model_loads(demo_model_dir, prompts_file, tmp_path):
    for bad in (["--max-new-tokens", "0"], ["--batch-size", "-1"], ["--top-p", "0"], ["--temperature", "x"]):
        rc, _, err, imported = run_cli("record", "--model", str(demo_model_dir / "target"), "--prompts",
                                       str(prompts_file), "--out", str(tmp_path / "x.sptrace"), *bad)
        assert rc == 2 and bad[0] in err and "Traceback" not in err, err
        assert imported == []
    rc, _, err, imported = run_cli("demo", "--max-new-tokens", "0", "--out", str(tmp_path / "d"))
    assert rc == 2 and "--max-new-tokens" in err and imported == []
    assert not (tmp_path / "d").exists() and not (tmp_path / "x.sptrace").exists()


def test_missing_model_directory_is_named_as_such(prompts_file, tmp_path, capsys):
    for model in (tmp_path / "no" / "model", "./missing-model"):
        assert main(["record", "--model", str(model), "--prompts", str(prompts_file), "--device", "cpu",
                     "--out", str(tmp_path / "x.sptrace")]) == 2
        err = capsys.readouterr().err
        assert "no such directory" in err and "hub id" not in err.split("no such directory")[0], err


def test_max_seq_len_is_the_models_limit(demo_model_dir, tmp_path, capsys):
    limit = json.loads((demo_model_dir / "target" / "config.json").read_text())["max_position_embeddings"]
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    base = ["record", "--model", str(demo_model_dir / "target"), "--draft", "none", "--device", "cpu",
            "--max-new-tokens", "4"]
    assert main([*base, "--prompts", str(prompts), "--out", str(tmp_path / "ok.sptrace")]) == 0
    assert Trace.load(tmp_path / "ok.sptrace").run_info["engine"]["max_seq_len"] == limit
    assert main([*base, "--prompts", str(prompts), "--max-seq-len", str(limit + 1),
                 "--out", str(tmp_path / "x.sptrace")]) == 2
    assert f"above the model's limit of {limit}" in capsys.readouterr().err
    # A prompt longer than the model's limit: refused before decoding, in prompt tokens and the limit.
    long = tmp_path / "long.txt"
    long.write_text("    x = x + 1  " * limit + "\n")
    assert main([*base, "--prompts", str(long), "--out", str(tmp_path / "x.sptrace")]) == 2
    err = capsys.readouterr().err
    assert "prompt 1 has" in err and f"the model's limit of {limit}" in err and "positions must be" not in err
    assert not (tmp_path / "x.sptrace").exists()


def test_trace_method_is_shown(recorded, tmp_path):
    trace = Trace.load(recorded)
    assert trace.method == "ngram" and "method='ngram'" in repr(trace)
    assert main(["report", str(recorded), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<title>spectool trace · ngram" in page and "method ?" not in page


def test_truncated_trace_is_named_and_an_empty_one_fails(tmp_path, recorded, capsys):
    path = tmp_path / "run.sptrace"
    full = make_trace("ngram", path=path, flush_every=4, num_requests=3)
    data = path.read_bytes()
    half = tmp_path / "half.sptrace"
    half.write_bytes(data[: len(data) // 2])
    kept = Trace.load(half).steps.num_rows
    assert 0 < kept < full.steps.num_rows
    assert main(["check", str(half)]) == 0
    captured = capsys.readouterr()
    line = [x for x in captured.err.splitlines() if "ends inside a batch" in x]
    assert len(line) == 1 and f"{kept} complete records recovered" in line[0]
    assert f"ok {half}: {kept} records" in captured.out
    # Cut inside the first batch, past the header (the CLI writes its records as one batch): no record survives.
    empty, data = tmp_path / "empty.sptrace", recorded.read_bytes()
    for cut in range(len(data) - 1, 0, -max(1, len(data) // 50)):
        empty.write_bytes(data[:cut])
        cut_trace = Trace.load(empty)
        if cut_trace.steps.num_rows == 0:
            break
    assert cut_trace.truncated and cut_trace.steps.num_rows == 0
    assert main(["check", str(empty)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAULT") and "0 complete records recovered" in out and "ok" not in out.split()[0]
    for command, output in (("report", tmp_path / "e.html"), ("export-perfetto", tmp_path / "e.json"),
                            ("summary", None)):
        assert main([command, str(empty), *(["-o", str(output)] if output else [])]) == 2
        assert "0 complete records recovered" in capsys.readouterr().err
        assert output is None or not output.exists()


def test_check_of_a_small_trace_needs_no_torch(recorded):
    rc, out, err, imported = run_cli("check", str(recorded))
    assert rc == 0 and out.startswith("ok"), err
    assert "torch" not in imported


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, demo_model_dir, prompts_file):
    """An ngram trace recorded by `spectool record`."""
    path = tmp_path_factory.mktemp("recorded") / "run.sptrace"
    assert main(["record", "--model", str(demo_model_dir / "target"), "--prompts", str(prompts_file),
                 "--max-new-tokens", "12", "--device", "cpu", "--out", str(path)]) == 0
    return path


@pytest.mark.parametrize("draft", ["ngram", "eagle", "multi_layer_eagle"])
def test_record_then_check_summary_report_perfetto(tmp_path, demo_model_dir, prompts_file, draft, capsys):
    trace = tmp_path / "run.sptrace"
    args = ["record", "--model", str(demo_model_dir / "target"), "--draft", draft, "--prompts", str(prompts_file),
            "--max-new-tokens", "12", "--device", "cpu", "--out", str(trace)]
    if draft != "ngram":
        args += ["--draft-path", str(demo_model_dir / draft)]
    assert main(args) == 0
    assert trace.is_file()
    assert main(["check", str(trace)]) == 0
    assert main(["summary", str(trace)]) == 0
    assert "accept" in capsys.readouterr().out.lower()
    assert main(["report", str(trace), "-o", str(tmp_path / "report.html")]) == 0
    assert (tmp_path / "report.html").stat().st_size > 100_000  # plotly.js is inlined
    assert main(["export-perfetto", str(trace), "-o", str(tmp_path / "perfetto.json")]) == 0
    events = json.loads((tmp_path / "perfetto.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("name") == "verify" for e in events)


def test_record_bad_input_is_one_line(tmp_path, demo_model_dir, prompts_file, capsys):
    def record(prompts, *extra):
        return main(["record", "--model", str(demo_model_dir / "target"), "--prompts", str(prompts),
                     "--device", "cpu", "--out", str(tmp_path / "x.sptrace"), *extra])

    assert record(prompts_file, "--draft", "eagle") == 2
    assert "needs --draft-path" in capsys.readouterr().err
    assert record(tmp_path / "missing.jsonl") == 2
    err = capsys.readouterr().err
    assert "cannot read prompts file" in err and "Traceback" not in err
    assert not (tmp_path / "x.sptrace").exists()


def test_demo_writes_table_traces_and_reports(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--num-prompts", "1", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    # Readable in 80 columns (pytest's capture is not a terminal: rich lays out for 80), names in full.
    assert max(map(len, printed.splitlines())) <= 80
    assert "multi_layer_eagle" in printed and "…" not in printed and "speedup on cpu" in printed
    plain = [r for r in summary if r["method"] == "plain"]
    assert all(r["mean_accept_length"] is None and r["device"] == "cpu" for r in plain)
    assert {(r["method"], r["workload"]) for r in summary} == {
        (m, w) for m in ("plain", "ngram", "eagle", "multi_layer_eagle", "eagle3") for w in ("completion", "editing")}
    for row in summary:
        assert (out / f"{row['method']}_{row['workload']}.sptrace").is_file()
        if row["method"] != "plain":
            assert (out / f"{row['method']}_{row['workload']}.html").is_file()
    assert "spectool demo" in printed


def test_bench_compares_with_plain(tmp_path, demo_model_dir, prompts_file):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(demo_model_dir / "target"), "--draft", "ngram", "--prompts",
                 str(prompts_file), "--max-new-tokens", "8", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["plain", "ngram"]
    assert rows[0]["mean_accept_length"] == 0.0


def test_summary_names_verified_and_emitted_tokens(target, demo_model_dir, tmp_path, capsys):
    import spectool as st

    prompts = load_prompts(demo_model_dir / "prompts.jsonl", "editing")[:2]
    new = 12
    engine = st.Engine(target, draft=st.NgramConfig(num_draft_tokens=12), max_batch_size=2, max_seq_len=2048)
    result = engine.generate([p[:400] for p in prompts], max_new_tokens=new, ignore_eos=True)
    result.trace.save(tmp_path / "t.sptrace")
    verified = result.trace.summary()["tokens"]
    emitted = len(prompts) * (new - 1)  # every request emits max_new_tokens, the first one by the prefill
    assert sum(len(t) for t in result.token_ids) == len(prompts) * new
    assert verified >= emitted
    assert main(["summary", str(tmp_path / "t.sptrace")]) == 0
    out = capsys.readouterr().out

    def row(name: str) -> str:
        return next(line for line in out.splitlines() if name in line).split("│")[2].strip()

    assert row("tokens emitted") == str(emitted) and row("tokens verified (accepted + bonus)") == str(verified)
    assert (f"{verified - emitted} verified tokens past max_new_tokens" in out) == (verified > emitted)
