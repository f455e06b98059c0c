"""Exact N-gram what-if: the real C++ trie, fed exactly as the engine feeds it.

For one ``NgramConfig`` the replay makes a fresh ``NgramCorpus`` and, on the engine's
schedule (the one ``schedule.replay`` describes), does what ``NgramDrafter`` does: every
admitted prompt (plus its first output token) is put with its request id, then
synchronized; each iteration gets the running requests' trees from their tails, in slot
order; the accepted tokens and the bonus are put as the window of the last
``max_trie_depth`` tokens before them plus them; finished requests' match state is
erased. The greedy verify is replaced by the recorded output: the accepted path is the
deepest root path whose every token is the next known token (ties to the lower node
index, as the verifier), and the bonus is the known token after it. So every call the
trie sees is the call the engine would have made, and the accept lengths are the engine's.

The loop runs inside the native module (``NgramCorpus.replay_greedy``): per iteration it
is a few trie calls, and a sweep runs it once per configuration.
"""

from __future__ import annotations

import numpy as np

from spectool.config import NgramConfig
from spectool.tune.prediction import FlatTrees, Prediction
from spectool.tune.workload import TuneError, Workload


def predict_ngram(config: NgramConfig, workload: Workload, encode=None) -> Prediction:
    """The exact greedy iterations of ``config`` over ``workload`` (see module docstring)."""
    from spectool.native import NgramCorpus

    corpus = NgramCorpus(max_trie_depth=config.max_trie_depth, min_bfs_breadth=config.min_bfs_breadth,
                         max_bfs_breadth=config.max_bfs_breadth, num_draft_tokens=config.num_draft_tokens,
                         match=config.match, capacity=config.capacity)
    if config.external_corpus is not None:
        if encode is None:
            raise TuneError("an external corpus needs the run's tokenizer, and this trace has none")
        from spectool.draft.ngram import read_corpus_texts

        chunks = [encode(text) for text in read_corpus_texts(config.external_corpus)]
        corpus.add_external_corpus(str(config.external_corpus), chunks, config.external_corpus_max_tokens)
    reqs = workload.requests
    got = corpus.replay_greedy([r.request_id for r in reqs], [r.known for r in reqs], [r.prompt_len for r in reqs],
                               [r.end for r in reqs], workload.max_batch_size)
    trees = FlatTrees(got["tree_tokens"], got["tree_parents"], got["tree_valid"], got["tree_offsets"])
    return Prediction(config, "ngram", got["iteration"], got["request_id"], got["seq_len"], got["accept_length"],
                      got["censored"], got["batch_size"], got["num_nodes"], workload.output_tokens,
                      {"ngram_match_len": np.asarray(got["match_len"], np.int64)}, trees)
