"""The `spectool` command line: record → check / summary / report / export-perfetto, demo, bench."""

from __future__ import annotations

import json

import pytest

from spectool.cli import COMMANDS, main
from spectool.prompts import load_prompts


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
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["method"], r["workload"]) for r in summary} == {
        (m, w) for m in ("plain", "ngram", "eagle", "multi_layer_eagle") for w in ("completion", "editing")}
    for row in summary:
        assert (out / f"{row['method']}_{row['workload']}.sptrace").is_file()
        if row["method"] != "plain":
            assert (out / f"{row['method']}_{row['workload']}.html").is_file()
    assert "spectool demo" in capsys.readouterr().out


def test_bench_compares_with_plain(tmp_path, demo_model_dir, prompts_file):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(demo_model_dir / "target"), "--draft", "ngram", "--prompts",
                 str(prompts_file), "--max-new-tokens", "8", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["plain", "ngram"]
    assert rows[0]["mean_accept_length"] == 0.0
