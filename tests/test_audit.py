"""`spectool audit`: plain against speculative decoding, greedy and sampled (demo model, CPU)."""

from __future__ import annotations

import inspect
import textwrap
from collections import Counter

import pytest

import spectool as st
from spectool import engine as engine_module
from spectool import verify as verify_module
from spectool.cli import audit as audit_cli
from spectool.trace.audit import chi2_homogeneity, greedy_audit, sampled_audit

DEMO = st.demo_model()


@pytest.fixture(scope="module")
def target():
    return st.load(str(DEMO / "target"))


@pytest.fixture(scope="module")
def short_prompts(target):
    text = (DEMO / "prompts.jsonl").read_text()
    ids = target.encode(text)
    return [ids[1000:1024], ids[3000:3020]]


def eagle():
    return st.EagleConfig(str(DEMO / "eagle"), num_steps=3, topk=2, num_draft_tokens=6)


def test_chi2_against_known_values():
    # Equal samples: statistic 0, p = 1; a 2 x 2 table with counts (60, 40) vs (40, 60): chi2 = 8.
    assert chi2_homogeneity(Counter({1: 50, 2: 50}), Counter({1: 50, 2: 50}))[::2] == (0.0, 1.0)
    chi2, dof, p = chi2_homogeneity(Counter({1: 60, 2: 40}), Counter({1: 40, 2: 60}))
    assert (round(chi2, 6), dof) == (8.0, 1) and p == pytest.approx(0.004678, rel=1e-3)


def test_greedy_audit_cli_passes_on_the_demo(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def main():\n    for i in range(10):\n")
    rc = audit_cli.main(["--model", str(DEMO / "target"), "--prompts", str(prompts), "--draft", "eagle",
                         "--draft-path", str(DEMO / "eagle"), "--max-new-tokens", "24", "--device", "cpu"])
    assert rc == 0 and "2 prompts: 2 identical, 0 near-ties, 0 bugs" in capsys.readouterr().out


def test_greedy_audit_names_a_divergence_that_is_not_a_near_tie(target, short_prompts, monkeypatch):
    real = engine_module.verify_greedy

    def wrong_bonus(tree, logits):  # the bonus one token id off whenever no draft was accepted
        res = real(tree, logits)
        if tree.num_nodes > 1:  # speculative trees only: plain decoding stays right
            res.bonus = res.bonus + (res.accept_length == 0)
        return res

    plain = st.Engine(target, None, max_batch_size=2, max_seq_len=512)
    spec = st.Engine(target, eagle(), max_batch_size=2, max_seq_len=512)
    assert not greedy_audit(plain, spec, short_prompts, 24).greedy  # float32 on the CPU: identical
    monkeypatch.setattr(engine_module, "verify_greedy", wrong_bonus)
    report = greedy_audit(plain, spec, short_prompts, 24)
    assert report.failures and all(not d.near_tie and d.speculative == d.plain + 1 for d in report.failures)


def test_sampled_audit_passes_clean_and_fails_a_threshold_fault(target, short_prompts, monkeypatch):
    plain = st.Engine(target, None, max_batch_size=16, max_seq_len=512)
    spec = st.Engine(target, eagle(), max_batch_size=16, max_seq_len=512)
    kwargs = dict(samples=600, positions=1, temperature=1.0, alpha=1e-3)
    clean = sampled_audit(plain, spec, short_prompts[:1], **kwargs)
    assert not clean.failures, [str(t) for t in clean.tests]
    # The torch sampling verify's tree decision (the one that records), read from its module at each call.
    source = textwrap.dedent(inspect.getsource(verify_module._sampled_decision))
    assert "coin_at_parent < cum" in source
    namespace = dict(vars(verify_module))
    exec(source.replace("coin_at_parent < cum", "coin_at_parent < cum + 0.2"), namespace)
    monkeypatch.setattr(verify_module, "_sampled_decision", namespace["_sampled_decision"])
    broken = sampled_audit(plain, spec, short_prompts[:1], **kwargs)
    assert [t.position for t in broken.failures] == [1]
