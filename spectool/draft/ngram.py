"""N-gram drafting: the trie proposes continuations of each request's tail.

The corpus is fed each prompt at prefill and the accepted tokens after every
verify (with request ids, so n-gram counts stay true); ``batch_get`` returns the
tree as tokens + mask (a ``MaskTree``), and the index kernel turns the mask into
positions and retrieve_* arrays inside the engine's verify step.

Under tensor parallelism the corpus lives on rank 0 alone: it drafts, and broadcasts each
iteration's trees (the staged bytes, with the node count in a header) to the other ranks, which
keep no corpus and put nothing. On CUDA the broadcast goes through the host group (gloo): the
trees are host data, and a receiving rank needs the node count on the host anyway.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from spectool.config import NgramConfig
from spectool.draft import Batch, Prefill
from spectool.draft.tree import MaskTree
from spectool.prompts import read_jsonl, read_text

if TYPE_CHECKING:
    from spectool.native import NgramDraft


PUT_LOG_TOKENS = 1 << 18  # tokens of corpus puts an engine keeps for its traces
HEADER = 4  # staging bytes before the trees: the node count (int32), for the ranks that receive them


class NgramDrafter:
    """Drafts from a ``NgramCorpus`` shared by all requests of the engine."""

    host_accepted = True  # on_verify feeds the accepted tokens to the trie
    reads_hidden = False  # the target's hidden states are never read (the engine keeps none after prefill)

    def __init__(self, config: NgramConfig, engine) -> None:
        from spectool.native import NgramCorpus

        self.config = config
        self.device = engine.device
        self.max_batch_size = engine.max_batch_size
        self.num_draft_tokens = config.num_draft_tokens
        self.tp = getattr(engine, "tp", None)
        # For the trace: tokens of each request given to the corpus so far, and every put since the
        # engine was made (a trace then holds what earlier runs left in the corpus), up to a budget.
        self._put_len: dict[int, int] = {}
        self.put_log: list | None = []
        self._logged_tokens = 0
        if self.tp is not None and self.tp.rank != 0:
            self.corpus = None  # rank 0 drafts and broadcasts the trees
            return
        self.corpus = NgramCorpus(
            max_trie_depth=config.max_trie_depth, min_bfs_breadth=config.min_bfs_breadth,
            max_bfs_breadth=config.max_bfs_breadth, num_draft_tokens=config.num_draft_tokens,
            match=config.match, capacity=config.capacity)
        if config.external_corpus is not None:
            chunks = [engine.target.encode(text) for text in read_corpus_texts(config.external_corpus)]
            self.corpus.add_external_corpus(str(config.external_corpus), chunks,
                                            config.external_corpus_max_tokens)

    def _put(self, kind: str, windows: list[list[int]], req_ids: list[int], total_lens: list[int]) -> None:
        if self.corpus is None:
            return
        self.corpus.batch_put(windows, req_ids=req_ids, total_lens=total_lens)
        self._put_len.update(zip(req_ids, total_lens))
        if self.put_log is not None:
            self._logged_tokens += sum(map(len, windows))
            if self._logged_tokens > PUT_LOG_TOKENS:
                self.put_log = None  # too long to record: the checker then skips the trie replay
            else:
                self.put_log.append([kind, list(req_ids), [list(w) for w in windows], list(total_lens)])

    def trace_info(self) -> dict:
        """What a new trace records about the corpus: the puts made before it started."""
        return {"ngram_prior_puts": None if self.put_log is None else list(self.put_log)}

    def allocate(self) -> None:
        """The trees' staging buffer (pinned on CUDA) and, on CUDA, its device twin.

        The trie writes each iteration's trees (int32 tokens, scores, mask and valid, one after
        another) straight into the staging buffer, which reaches the device in one copy; the
        views of both buffers are made once per batch size. Only the host-side fields the
        device never reads (parents, match lengths, breadths) live in ordinary arrays.
        """
        n, b = self.num_draft_tokens, self.max_batch_size
        self._nbytes_per_row = 9 * n + n * n
        self._staging = torch.zeros(HEADER + b * self._nbytes_per_row, dtype=torch.uint8,
                                    pin_memory=self.device.type == "cuda")
        self._device_buf = (torch.empty_like(self._staging, device=self.device)
                            if self.device.type == "cuda" else None)
        self._views: dict[int, tuple[NgramDraft, tuple[torch.Tensor, ...]]] = {}

    def _buffers(self, b: int) -> tuple[NgramDraft, tuple[torch.Tensor, ...]]:
        """(the trie's output arrays for b rows, the device tensors its staged part lands in)."""
        if b not in self._views:
            from spectool.native import NgramDraft

            n = self.num_draft_tokens
            shapes = ((b, n), (b, n), (b, n, n), (b, n))  # tokens, scores, mask, valid
            dtypes = ((np.int32, torch.int32), (np.float32, torch.float32), (np.bool_, torch.bool),
                      (np.bool_, torch.bool))
            sizes = [int(np.prod(shape)) * np.dtype(d).itemsize for shape, (d, _) in zip(shapes, dtypes)]
            ends = HEADER + np.cumsum(sizes)
            host = self._staging.numpy()
            staged = [host[end - size:end].view(d).reshape(shape)
                      for shape, (d, _), size, end in zip(shapes, dtypes, sizes, ends)]
            dev = self._device_buf if self._device_buf is not None else self._staging
            on_device = tuple(dev[end - size:end].view(t).view(shape)
                              for shape, (_, t), size, end in zip(shapes, dtypes, sizes, ends))
            tokens, scores, mask, valid = staged
            out = NgramDraft(tokens, np.empty((b, n), np.int32), mask, valid, scores,
                             np.empty(b, np.int32), np.empty(b, np.int32))
            self._views[b] = (out, on_device)
        return self._views[b]

    def on_admit(self, request_ids: list[int], prompts: list[list[int]]) -> None:
        # Inserting whole prompts costs about 1 ms per thousand tokens on one core: queued here,
        # before the target's prefill, the worker thread does it while the GPU prefills.
        self._put("admit", prompts, request_ids, [len(p) for p in prompts])

    def on_prefill(self, prefill: Prefill) -> None:
        # Then only the first sampled token is new for each request (the put state continues
        # from on_admit's), which counts exactly what one put of the whole history would.
        depth = self.config.max_trie_depth
        self._put("prefill", [h[-depth:] for h in prefill.histories], prefill.request_ids,
                  [len(h) for h in prefill.histories])
        # Wait after the last group's prefill, not in the first decode iteration's get: the prompts'
        # insertion (queued at on_admit, about 1 ms per thousand tokens) then overlaps every group's
        # forward, where a wait after each group held the later groups back until it finished.
        if self.corpus is not None and prefill.last_group:
            self.corpus.synchronize()

    def draft(self, batch: Batch, timer) -> tuple[MaskTree, dict]:
        out, on_device = self._buffers(len(batch.request_ids))
        if self.corpus is None:  # another rank than 0 of a split target: rank 0's trees
            with timer("trie_get"):
                n = int(self._broadcast_trees(len(batch.request_ids)))
            with timer("index"):
                tokens, scores, mask, valid = self._to_device(on_device, n)
            return MaskTree(tokens, scores, mask, valid, batch.seq_lens, max_depth=n - 1), {}
        depth = self.config.max_trie_depth
        with timer("trie_get"):
            self.corpus.synchronize()
            got = self.corpus.batch_get(batch.request_ids, [h[-depth:] for h in batch.histories],
                                        [len(h) for h in batch.histories], out=out)
        with timer("index"):
            # No row matched anything: verify the roots alone, a plain decoding step, instead of N
            # nodes of padding (a third of the iterations on free completion; valid nodes come first).
            n = self.num_draft_tokens if got.valid[:, 1:].any() else 1
            if self.tp is not None:
                self._broadcast_trees(len(batch.request_ids), n)
            tokens, scores, mask, valid = self._to_device(on_device, n)
            tree = MaskTree(tokens, scores, mask, valid, batch.seq_lens, max_depth=n - 1)
        # Copies: the arrays are rewritten by the next get, and the recorder keeps these.
        put_len = np.array([self._put_len.get(r, 0) for r in batch.request_ids], dtype=np.int32)
        return tree, {"ngram_match_len": got.match_len.copy(), "ngram_breadth": got.breadth.copy(),
                      "ngram_put_len": put_len}

    def _broadcast_trees(self, b: int, n: int = 0) -> int:
        """Rank 0's staged trees of ``b`` rows and their node count ``n`` on every rank (one
        broadcast of the staging buffer's used part); the node count."""
        used = self._staging[:HEADER + b * self._nbytes_per_row]
        count = used[:HEADER].view(torch.int32)
        if self.tp.rank == 0:
            count.fill_(n)
        self.tp.broadcast_host(used)
        return int(count[0])

    def _to_device(self, on_device: tuple[torch.Tensor, ...], n: int) -> tuple[torch.Tensor, ...]:
        """(tokens, scores, mask, valid) of the staged trees on the engine's device, cut to their
        first n nodes. On CUDA one asynchronous copy fills the device twin: the staging buffer
        is rewritten only after the engine's next host sync, by which time the copy and the
        verify reading the twin are done. On the CPU the trees are cloned, since the buffer is
        shared by every iteration."""
        nbytes = HEADER + self._nbytes_per_row * on_device[0].shape[0]
        if self._device_buf is not None:
            self._device_buf[:nbytes].copy_(self._staging[:nbytes], non_blocking=True)
        else:
            on_device = tuple(t.clone() for t in on_device)
        tokens, scores, mask, valid = on_device
        if n < tokens.shape[1]:
            tokens, scores, mask, valid = tokens[:, :n], scores[:, :n], mask[:, :n, :n], valid[:, :n]
        return tokens, scores, mask, valid

    def on_verify(self, batch: Batch, tree: MaskTree, result, hidden: torch.Tensor,
                  accepted: list[list[int]], timer) -> None:
        with timer("trie_put"):
            # Each window is the last max_trie_depth tokens before the gained ones plus those (histories
            # do not hold them yet): O(depth) per request, however long its history.
            depth = self.config.max_trie_depth
            windows = [h[-depth:] + a for h, a in zip(batch.histories, accepted)]
            self._put("verify", windows, batch.request_ids,
                      [len(h) + len(a) for h, a in zip(batch.histories, accepted)])

    def release(self, request_ids: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.erase_match_state(request_ids)
        for r in request_ids:
            self._put_len.pop(r, None)


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
