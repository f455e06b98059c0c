"""N-gram drafting: the trie proposes continuations of each request's tail.

The corpus is fed each prompt at prefill and the accepted tokens after every
verify (with request ids, so n-gram counts stay true); ``batch_get`` returns the
tree as tokens + mask (a ``MaskTree``), and the index kernel turns the mask into
positions and retrieve_* arrays inside the engine's verify step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from spectool.config import NgramConfig
from spectool.draft import Batch
from spectool.draft.tree import MaskTree
from spectool.prompts import read_jsonl, read_text


class NgramDrafter:
    """Drafts from a ``NgramCorpus`` shared by all requests of the engine."""

    host_accepted = True  # on_verify feeds the accepted tokens to the trie

    def __init__(self, config: NgramConfig, engine) -> None:
        from spectool.native import NgramCorpus

        self.config = config
        self.device = engine.device
        self.max_batch_size = engine.max_batch_size
        self.num_draft_tokens = config.num_draft_tokens
        self.corpus = NgramCorpus(
            max_trie_depth=config.max_trie_depth, min_bfs_breadth=config.min_bfs_breadth,
            max_bfs_breadth=config.max_bfs_breadth, num_draft_tokens=config.num_draft_tokens,
            match=config.match, capacity=config.capacity)
        if config.external_corpus is not None:
            chunks = [engine.target.encode(text) for text in read_corpus_texts(config.external_corpus)]
            self.corpus.add_external_corpus(str(config.external_corpus), chunks,
                                            config.external_corpus_max_tokens)

    def allocate(self) -> None:
        """A staging buffer (pinned on CUDA): each iteration's trees (tokens as int64, scores, mask
        and valid, one after another) reach the device in one copy instead of four, with no cast."""
        n = self.num_draft_tokens
        self._staging = torch.zeros(self.max_batch_size * (12 * n + n * n + n), dtype=torch.uint8,
                                    pin_memory=self.device.type == "cuda")

    def on_prefill(self, batch: Batch, hiddens: list[torch.Tensor]) -> None:
        self.corpus.batch_put(batch.histories, req_ids=batch.request_ids,
                              total_lens=[len(h) for h in batch.histories])
        # Inserting whole prompts is prefill work (about 1 ms per thousand tokens on one core):
        # wait for it here, in the prefill, rather than in the first decode iteration's get.
        self.corpus.synchronize()

    def draft(self, batch: Batch, timer) -> tuple[MaskTree, dict]:
        depth = self.config.max_trie_depth
        with timer("trie_get"):
            self.corpus.synchronize()
            got = self.corpus.batch_get(batch.request_ids, [h[-depth:] for h in batch.histories],
                                        [len(h) for h in batch.histories])
        with timer("index"):
            # No row matched anything: verify the roots alone, a plain decoding step, instead of N
            # nodes of padding (a third of the iterations on free completion; valid nodes come first).
            n = self.num_draft_tokens if got.valid[:, 1:].any() else 1
            tokens, scores, mask, valid = self._to_device(got, n)
            tree = MaskTree(tokens, scores, mask, valid, batch.seq_lens, max_depth=n - 1)
        return tree, {"ngram_match_len": got.match_len, "ngram_breadth": got.breadth}

    def _to_device(self, got, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens int64, scores, mask, valid) of the trie's trees, cut to their first n nodes, on
        the engine's device. The staging buffer is rewritten only after the engine's next host
        sync, so the copy is safe."""
        fields = (got.tokens[:, :n].astype(np.int64), np.ascontiguousarray(got.scores[:, :n]),
                  np.ascontiguousarray(got.mask[:, :n, :n]), np.ascontiguousarray(got.valid[:, :n]))
        dtypes = (torch.int64, torch.float32, torch.bool, torch.bool)
        host = self._staging.numpy()
        ends = np.cumsum([a.nbytes for a in fields])
        for a, end in zip(fields, ends):
            host[end - a.nbytes:end] = a.reshape(-1).view(np.uint8)
        flat = self._staging[:ends[-1]].to(self.device, non_blocking=True, copy=True)
        tokens, scores, mask, valid = (flat[end - a.nbytes:end].view(dtype).view(a.shape)
                                       for a, end, dtype in zip(fields, ends, dtypes))
        return tokens, scores, mask, valid

    def on_verify(self, batch: Batch, tree: MaskTree, result, hidden: torch.Tensor,
                  accepted: list[list[int]], timer) -> None:
        with timer("trie_put"):
            # Each window is the last max_trie_depth tokens before the gained ones plus those (histories
            # do not hold them yet): O(depth) per request, however long its history.
            depth = self.config.max_trie_depth
            windows = [h[-depth:] + a for h, a in zip(batch.histories, accepted)]
            self.corpus.batch_put(windows, req_ids=batch.request_ids,
                                  total_lens=[len(h) + len(a) for h, a in zip(batch.histories, accepted)])

    def release(self, batch: Batch) -> None:
        self.corpus.erase_match_state(batch.request_ids)


def read_corpus_texts(path: str | Path) -> list[str]:
    """Texts of an external corpus: a JSONL file (one object per line with a "text"
    field, or a JSON string per line) or any other file as one plain text."""
    path = Path(path)
    raw = read_text(path, "external corpus")
    if path.suffix != ".jsonl":
        return [raw]
    texts = []
    for lineno, obj in read_jsonl(path, raw):
        text = obj.get("text") if isinstance(obj, dict) else obj
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: expected a string or an object with a 'text' string")
        texts.append(text)
    return texts
