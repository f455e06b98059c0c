"""N-gram drafting from an external corpus (NgramConfig(external_corpus=...)): lossless,
and drafting from text the request has not seen yet raises acceptance."""

from __future__ import annotations

import json

import pytest

import spectool as st
from spectool.train.data import stdlib_root


@pytest.fixture(scope="module")
def held_out_source() -> str:
    # A held-out module (never trained on): the corpus holds the whole file, the prompt its start.
    return (stdlib_root() / "textwrap.py").read_text()


def _run(target, config, prompt: str):
    engine = st.Engine(target, draft=config, max_batch_size=1, max_seq_len=1024)
    return engine.generate([prompt], max_new_tokens=48, record=False)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_external_corpus_is_lossless_and_helps(target, held_out_source, tmp_path, suffix):
    prompt = held_out_source[:1200]
    plain = _run(target, None, prompt)
    # The corpus holds the text the target goes on to write (as a document it quotes would),
    # which the request itself has not seen: drafts from it must be accepted more often.
    text = held_out_source[:600] + prompt + target.decode(plain.token_ids[0])
    path = tmp_path / f"corpus{suffix}"
    if suffix == ".jsonl":
        half = len(text) // 2
        path.write_text(json.dumps({"text": text[:half]}) + "\n" + json.dumps(text[half:]) + "\n")
    else:
        path.write_text(text)
    without = _run(target, st.NgramConfig(), prompt)
    with_corpus = _run(target, st.NgramConfig(external_corpus=path), prompt)
    assert without.token_ids == plain.token_ids
    assert with_corpus.token_ids == plain.token_ids
    assert with_corpus.stats.mean_accept_length > without.stats.mean_accept_length


def test_bad_external_corpus(target, tmp_path):
    with pytest.raises(ValueError, match="not a readable file"):
        st.NgramConfig(external_corpus=tmp_path / "missing.txt")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        st.Engine(target, draft=st.NgramConfig(external_corpus=bad))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"prompt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"wrong.jsonl:1: expected a string"):
        st.Engine(target, draft=st.NgramConfig(external_corpus=wrong))
