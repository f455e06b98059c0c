"""Faults planted in the engine, one per class, each named by `spectool check` at its iteration,
request and node; clean traces of every method, greedy and sampled, pass (the demo model, CPU).

Each fault is planted with monkeypatch. Where the checker's answer is not obvious from the
trace alone, the oracle is a clean run of the same engine on the same prompts: before the
first record that differs between the two runs everything is identical, so that record is
where the fault first shows.
"""

from __future__ import annotations

import inspect
import json
import textwrap

import numpy as np
import pyarrow as pa
import pytest

import spectool as st
from spectool import engine as engine_module
from spectool import verify as verify_module
from spectool.draft import multi_layer_eagle, ngram, tree
from spectool.trace import reference as ref
from spectool.trace.check import check_trace
from spectool.trace.recorder import Recorder
from spectool.trace.replay import replay

DEMO = st.demo_model()
MAX_NEW = 32


@pytest.fixture(scope="module")
def target():
    return st.load(str(DEMO / "target"))


@pytest.fixture(scope="module")
def prompts():
    lines = (DEMO / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:6]]


def draft_config(method: str):
    return {"ngram": st.NgramConfig(num_draft_tokens=8),
            "eagle": st.EagleConfig(str(DEMO / "eagle"), num_steps=3, topk=2, num_draft_tokens=6),
            "multi_layer_eagle": st.MultiLayerEagleConfig(str(DEMO / "multi_layer_eagle"), num_steps=3),
            "none": None}[method]


def run(target, prompts, method: str, temperature: float = 0.0, engine=None):
    prompts = prompts[:3]
    engine = engine or st.Engine(target, draft=draft_config(method), max_batch_size=2, max_seq_len=1024)
    return engine.generate(prompts, max_new_tokens=MAX_NEW, temperature=temperature, seed=1).trace


def rows_sorted(trace):
    return trace.steps.sort_by([("iteration", "ascending"), ("request_id", "ascending")]).to_pylist()


def first_difference(clean, broken, fields):
    """(iteration, request, node) of the first record whose ``fields`` differ between two runs."""
    for a, b in zip(rows_sorted(clean), rows_sorted(broken)):
        assert (a["iteration"], a["request_id"]) == (b["iteration"], b["request_id"])
        for name in fields:
            x, y = a[name], b[name]
            if name == "scores":
                far = [i for i, (u, v) in enumerate(zip(x, y)) if abs(u - v) > 1e-3]
            else:
                far = [i for i, (u, v) in enumerate(zip(x, y)) if u != v] or ([min(len(x), len(y))]
                                                                              if len(x) != len(y) else [])
            if far:
                return a["iteration"], a["request_id"], far[0]
    raise AssertionError("the planted fault changed nothing")


def named(fault):
    assert fault is not None, "the checker found nothing"
    return fault.iteration, fault.request_id, fault.node


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["none", "ngram", "eagle", "multi_layer_eagle"])
def test_clean_traces_pass_check_and_replay(target, prompts, method, temperature):
    trace = run(target, prompts, method, temperature)
    assert check_trace(trace) is None
    if temperature > 0:
        assert trace.steps.column("child_probs").null_count < trace.steps.num_rows  # sampled decisions checked
    report = replay(trace, str(DEMO / "target"))
    assert report.fault is None and not report.divergences, (report.fault, report.divergences)


def test_index_construction_fault(target, prompts, monkeypatch):
    real = tree.reconstruct_indices_from_tree_mask

    def no_siblings(mask, seq_lens, **kwargs):  # a next-sibling pointer that is never set
        positions, index, next_token, next_sibling, parents = real(mask, seq_lens, **kwargs)
        return positions, index, next_token, next_sibling.clamp(max=-1), parents

    monkeypatch.setattr(tree, "reconstruct_indices_from_tree_mask", no_siblings)
    trace = run(target, prompts, "ngram")
    want = next((r["iteration"], r["request_id"], i) for r in rows_sorted(trace)
                for i, s in enumerate(ref.tree_indices(r["parents"], r["seq_len"])["retrieve_next_sibling"])
                if s >= 0)
    fault = check_trace(trace)
    assert named(fault) == want and "retrieve_next_sibling" in fault.message


def test_decision_fault(target, prompts, monkeypatch):
    real = engine_module.verify_greedy

    def forgets_rejections(tree, logits):
        res = real(tree, logits)
        res.status = res.status.masked_fill(res.status == ref.REJECTED, ref.NOT_VISITED)
        return res

    monkeypatch.setattr(engine_module, "verify_greedy", forgets_rejections)
    trace = run(target, prompts, "eagle")
    want = next((r["iteration"], r["request_id"], i) for r in rows_sorted(trace)
                for i, s in enumerate(ref.greedy_decision(r["tokens"], r["parents"], r["valid"],
                                                          r["target_argmax"]).status) if s == ref.REJECTED)
    fault = check_trace(trace)
    assert named(fault) == want and "status" in fault.message


def test_commit_fault(target, prompts, monkeypatch):
    real = engine_module.commit_kv

    def commits_one(k, v, slots, seq_lens, path, length, rows=False):  # moves only the first accepted node
        return real(k, v, slots, seq_lens, path, length.clamp(max=1), rows=rows)

    monkeypatch.setattr(engine_module, "commit_kv", commits_one)
    trace = run(target, prompts, "multi_layer_eagle")
    want = next((r["iteration"], r["request_id"], r["accept_path"][2]) for r in rows_sorted(trace)
                if r["accept_length"] >= 2)
    fault = check_trace(trace)
    assert named(fault) == want and "KV commit" in fault.message


def test_sampling_threshold_fault(target, prompts, monkeypatch):
    # The coin compared with the cumulative mass plus a slack: children are accepted too often.
    # The torch sampling verify's tree decision (the one that records), read from its module at each call.
    source = textwrap.dedent(inspect.getsource(verify_module._sampled_decision))
    assert "coin_at_parent < cum" in source
    namespace = dict(vars(verify_module))
    exec(source.replace("coin_at_parent < cum", "coin_at_parent < cum + 0.1"), namespace)
    monkeypatch.setattr(verify_module, "_sampled_decision", namespace["_sampled_decision"])
    trace = run(target, prompts, "eagle", temperature=0.8)
    want = None
    for r in rows_sorted(trace):  # the first visited node whose coin fell in the slack
        for level, x in enumerate(r["accept_path"]):
            kids = ref.sampled_children(r["tokens"], r["parents"], r["valid"], x, r["child_probs"])
            cum = np.cumsum([p for _, p in kids]) if kids else np.zeros(0)
            u = r["coins"][x]
            true_pick = next((c for (c, p), s in zip(kids, cum) if p > 0 and u < s), None)
            taken = r["accept_path"][level + 1] if level + 1 < len(r["accept_path"]) else None
            if true_pick != taken:
                want = (r["iteration"], r["request_id"], taken if taken is not None else x)
                break
        if want:
            break
    assert want is not None
    fault = check_trace(trace)
    assert named(fault) == want and "coins" in fault.message


def test_draft_position_fault(target, prompts, monkeypatch):
    # After a verify, layer 1 feeds its window one position ahead of the keys its prefill cached
    # (a uniform shift would be harmless under RoPE): its drafts are still tokens, the output
    # is still lossless, only acceptance drops; the replay of the draft layers names it.
    source = textwrap.dedent(inspect.getsource(multi_layer_eagle.MultiLayerEagleDrafter._layer_step))
    assert "hidden[rows, index], positions," in source
    namespace = dict(vars(multi_layer_eagle))
    planted = "hidden[rows, index], positions + (k == 1 and window is None),"
    exec(source.replace("hidden[rows, index], positions,", planted), namespace)
    clean = run(target, prompts, "multi_layer_eagle")
    monkeypatch.setattr(multi_layer_eagle.MultiLayerEagleDrafter, "_layer_step", namespace["_layer_step"])
    broken = run(target, prompts, "multi_layer_eagle")
    assert check_trace(broken) is None  # self-consistent: only the replay can tell
    want = first_difference(clean, broken, ["tokens", "scores"])
    assert want[2] == 2  # layer 1 drafts node 2
    fault = replay(broken, str(DEMO / "target")).fault
    assert named(fault) == want and "draft layer 1" in fault.message


def test_drafter_state_across_requests_fault(target, prompts, monkeypatch):
    # Ids restart at 0 in every generate call; a release that forgets to erase leaves the old
    # request's put progress, so the corpus skips the new request's first tokens.
    clean_engine = st.Engine(target, draft=draft_config("ngram"), max_batch_size=2, max_seq_len=1024)
    run(target, prompts, "ngram", engine=clean_engine)
    second = prompts[3:]
    clean = run(target, second, "ngram", engine=clean_engine)
    assert clean.run_info["ngram_prior_puts"]  # the first run's puts travel with the second trace
    assert replay(clean, str(DEMO / "target")).fault is None
    monkeypatch.setattr(ngram.NgramDrafter, "release", lambda self, batch: None)
    engine = st.Engine(target, draft=draft_config("ngram"), max_batch_size=2, max_seq_len=1024)
    run(target, prompts, "ngram", engine=engine)
    broken = run(target, second, "ngram", engine=engine)
    assert check_trace(broken) is None
    want = first_difference(clean, broken, ["tokens", "parents"])
    fault = replay(broken, str(DEMO / "target")).fault
    assert named(fault) == want and "reference corpus" in fault.message


def test_trie_structure_fault(target, prompts, monkeypatch):
    # The trie is given windows with two tokens swapped: it then holds n-grams that never occurred.
    real = ngram.NgramDrafter._put

    def swapped(self, kind, windows, req_ids, total_lens):
        windows = [w[:-3] + [w[-2], w[-3]] + w[-1:] if len(w) > 3 else w for w in windows]
        return real(self, kind, windows, req_ids, total_lens)

    clean = run(target, prompts, "ngram")
    monkeypatch.setattr(ngram.NgramDrafter, "_put", swapped)
    broken = run(target, prompts, "ngram")
    assert check_trace(broken) is None
    want = first_difference(clean, broken, ["tokens", "parents"])
    fault = replay(broken, str(DEMO / "target")).fault
    assert named(fault) == want and "reference corpus" in fault.message


def test_recorder_alignment_fault(target, prompts, monkeypatch):
    real = Recorder.record_batch

    def rolled(self, fields, packed=None):  # request ids one row off within the batch
        if "request_id" in fields and len(fields["request_id"]) > 1:
            fields = dict(fields, request_id=np.roll(fields["request_id"], 1))
        return real(self, fields, packed)

    monkeypatch.setattr(Recorder, "record_batch", rolled)
    trace = run(target, prompts, "ngram")
    first_batch = min(r["iteration"] for r in rows_sorted(trace))
    fault = check_trace(trace)
    assert fault is not None and (fault.iteration, fault.request_id) == (first_batch, 0)
    assert "history" in fault.message or "root token" in fault.message


def test_cli_replays_a_sampled_trace_and_names_a_fault(target, prompts, tmp_path, capsys, monkeypatch):
    from spectool.cli import check as check_cli

    path = tmp_path / "sampled.sptrace"
    run(target, prompts, "multi_layer_eagle", temperature=0.8).save(path)
    assert check_cli.main([str(path), "--replay", str(DEMO / "target")]) == 0  # sampled is not unreadable
    assert "consistent and replayed" in capsys.readouterr().out
    real = engine_module.commit_kv
    monkeypatch.setattr(engine_module, "commit_kv", lambda k, v, slots, seq_lens, path, length, rows=False: real(
        k, v, slots, seq_lens, path, length.clamp(max=1), rows=rows))
    run(target, prompts, "multi_layer_eagle", temperature=0.8).save(path)
    assert check_cli.main([str(path), "--replay", str(DEMO / "target")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("FAULT") and "KV commit" in out[-1]


def test_a_trace_without_the_newer_columns_still_checks(target, prompts):
    from spectool.trace.format import DISK_FIELDS, split_disk_table, to_disk_batch
    from spectool.trace.reader import Trace
    from spectool.trace.schema import OPTIONAL_STEP_FIELDS

    trace = run(target, prompts, "ngram", temperature=0.8)
    old = trace.steps.drop_columns(sorted(OPTIONAL_STEP_FIELDS))
    assert check_trace(Trace.from_tables(old, trace.requests, trace.run_info)) is None
    disk = pa.Table.from_batches([to_disk_batch(trace.steps, trace.requests, pa.schema(DISK_FIELDS))])
    steps, requests = split_disk_table(disk.drop_columns(sorted(OPTIONAL_STEP_FIELDS)))
    assert steps.column("child_probs").null_count == steps.num_rows
    assert check_trace(Trace(steps, requests, trace.run_info)) is None


def test_replay_recomputes_the_target_view_off_the_accepted_path(target, prompts):
    from spectool.trace.reader import Trace
    from spectool.trace.schema import STEP_SCHEMA

    trace = run(target, prompts, "eagle")
    rows = trace.steps.to_pylist()
    order = sorted(range(len(rows)), key=lambda k: (rows[k]["iteration"], rows[k]["request_id"]))
    k, node = next((k, i) for k in order[3:] for i in range(rows[k]["num_nodes"])
                   if rows[k]["status"][i] == ref.REJECTED)
    rows[k]["target_argmax"][node] = (rows[k]["target_argmax"][node] + 1) % 100
    broken = Trace(pa.Table.from_pylist(rows, schema=STEP_SCHEMA), trace.requests, trace.run_info)
    assert check_trace(broken) is None  # the decision never read the target at a rejected node
    report = replay(broken, str(DEMO / "target"))
    assert named(report.fault) == (rows[k]["iteration"], rows[k]["request_id"], node)
    assert [(d.iteration, d.node, d.near_tie) for d in report.divergences] == [(rows[k]["iteration"], node, False)]


def test_eagle_tree_growth_fault(target, prompts, monkeypatch):
    # Path scores multiplied onto the first step's scores instead of the parent step's: the tree
    # is still made of drafted tokens (lossless), but not the one EAGLE-2 grows.
    from spectool.draft import eagle

    source = textwrap.dedent(inspect.getsource(eagle.EagleDrafter._draft_candidates))
    assert "torch.mul(chosen_p[:, s - 1, :, None], p," in source
    namespace = dict(vars(eagle))
    exec(source.replace("torch.mul(chosen_p[:, s - 1, :, None], p,", "torch.mul(chosen_p[:, 0, :, None], p,"),
         namespace)
    clean = run(target, prompts, "eagle")
    monkeypatch.setattr(eagle.EagleDrafter, "_draft_candidates", namespace["_draft_candidates"])
    broken = run(target, prompts, "eagle")
    assert check_trace(broken) is None
    want = first_difference(clean, broken, ["step_topk_tokens", "step_topk_probs", "tokens"])
    fault = replay(broken, str(DEMO / "target")).fault
    assert fault is not None and (fault.iteration, fault.request_id) == want[:2] and "EAGLE" in fault.message
