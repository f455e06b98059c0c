"""Exact N-gram what-if: the real C++ trie, fed exactly as the engine feeds it.

For one ``NgramConfig`` the replay makes a fresh ``NgramCorpus`` and, on the engine's
schedule (``schedule.replay``), does what ``NgramDrafter`` does: every admitted prompt
(plus its first output token) is put with its request id, then synchronized; each
iteration gets the running requests' trees from their tails, in slot order; the
accepted tokens and the bonus are put as the window of the last ``max_trie_depth``
tokens before them plus them; finished requests' match state is erased. The greedy
verify is replaced by the recorded output: the accepted path is the deepest root path
whose every token is the next known token (ties to the lower node index, as the
verifier), and the bonus is the known token after it. So every call the trie sees is
the call the engine would have made, and the accept lengths are the engine's.
"""

from __future__ import annotations

import numpy as np

from spectool.config import NgramConfig
from spectool.tune.accept import accept_against
from spectool.tune.prediction import Prediction, RowLog
from spectool.tune.schedule import Running, replay
from spectool.tune.workload import TuneError, Workload


class NgramReplay:
    """The N-gram drafter's side of the engine loop for one configuration (see module docstring)."""

    def __init__(self, config: NgramConfig, workload: Workload, encode=None) -> None:
        from spectool.native import NgramCorpus

        self.config = config
        self.depth = config.max_trie_depth
        self.n = config.num_draft_tokens
        self.corpus = NgramCorpus(max_trie_depth=config.max_trie_depth, min_bfs_breadth=config.min_bfs_breadth,
                                  max_bfs_breadth=config.max_bfs_breadth, num_draft_tokens=config.num_draft_tokens,
                                  match=config.match, capacity=config.capacity)
        if config.external_corpus is not None:
            if encode is None:
                raise TuneError("an external corpus needs the run's tokenizer, and this trace has none")
            from spectool.draft.ngram import read_corpus_texts

            chunks = [encode(text) for text in read_corpus_texts(config.external_corpus)]
            self.corpus.add_external_corpus(str(config.external_corpus), chunks, config.external_corpus_max_tokens)
        self._known = {r.request_id: r.known.tolist() for r in workload.requests}
        self.match_len: list[int] = []

    def admit(self, reqs: list[Running]) -> None:
        # As NgramDrafter does: the prompts when they are admitted, then each one's first token
        # after the prefill (two puts: the recency order they leave is what BFS drafts by).
        ids = [r.request_id for r in reqs]
        histories = [self._known[r.request_id][:r.history_len] for r in reqs]
        prompts = [h[:-1] for h in histories]
        self.corpus.batch_put(prompts, req_ids=ids, total_lens=[len(p) for p in prompts])
        self.corpus.batch_put([h[-self.depth:] for h in histories], req_ids=ids,
                              total_lens=[len(h) for h in histories])
        self.corpus.synchronize()

    def step(self, running: list[Running]) -> tuple[list[int], int, list[bool], list]:
        depth, known_of, corpus = self.depth, self._known, self.corpus
        rids = [r.work.request_id for r in running]
        knowns = [known_of[rid] for rid in rids]
        lens = [r.seq_len + 1 for r in running]
        tails = [h[max(0, end - depth):end] for h, end in zip(knowns, lens)]
        corpus.synchronize()
        got = corpus.batch_get(rids, tails, lens)
        valid = got.valid
        n = self.n if valid[:, 1:].any() else 1
        self.match_len.extend(got.match_len.tolist())
        accepts, censored, trees = [], [], []
        if n > 1:
            tokens, parents, valid_rows = got.tokens.tolist(), got.parents.tolist(), valid.tolist()
            for b, r in enumerate(running):
                a, cut = accept_against(tokens[b], parents[b], valid_rows[b], knowns[b], r.seq_len)
                accepts.append(a)
                censored.append(cut)
                trees.append((tokens[b], parents[b], valid_rows[b]))
        else:  # no row matched: the engine verifies the roots alone
            for b, r in enumerate(running):
                accepts.append(0)
                censored.append(r.seq_len + 1 >= len(knowns[b]))
                trees.append(([knowns[b][r.seq_len]], [-1], [True]))
        # One put per window: the worker thread applies a batch's windows one after another, in
        # order, exactly as these calls do inline (a small put with none pending runs on the caller's
        # thread), and a hand-off per iteration would cost more than the replay's own work.
        put = corpus.batch_put
        for b, rid in enumerate(rids):
            h, end0 = knowns[b], lens[b]
            end = min(end0 + accepts[b] + 1, len(h))
            put([h[max(0, end0 - depth):end]], req_ids=[rid], total_lens=[end])
        return accepts, n, censored, trees

    def release(self, reqs: list[Running]) -> None:
        self.corpus.erase_match_state([r.request_id for r in reqs])


def predict_ngram(config: NgramConfig, workload: Workload, encode=None) -> Prediction:
    """The exact greedy iterations of ``config`` over ``workload`` (see module docstring)."""
    method = NgramReplay(config, workload, encode)
    log = RowLog()
    replay(workload, method, log)
    return log.finish(config, "ngram", workload.output_tokens, ngram_match_len=np.asarray(method.match_len))
