"""The decode loop: prefill, draft, verify, accept, commit, record.

One iteration for the running batch::

    tree   = drafter.draft(batch)                       # DraftTree, N nodes per request
    hidden = target(tree.tokens, tree.positions, ...)   # tree verify over the full prefix
    result = verify(tree, logits)                       # accepted path + bonus per request
    commit_kv(...)                                      # accepted K/V to contiguous slots
    drafter.on_verify(...)                              # feed the trie / draft-extend
    recorder.record_batch(...)                          # every tree, mask and decision

Plain decoding (``draft=None``) is the same loop with a one-node tree.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from spectool.config import DraftConfig
from spectool.draft import Batch, Prefill, make_drafter, prefill_groups
from spectool.draft.tree import DraftTree, MaskTree, chain_tree
from spectool.graphs import GraphRunner
from spectool.kernels import ops
from spectool.kernels.sampling import sampling_coins
from spectool.kernels.tree_indices import triton_on_cpu
from spectool.model.llama import positions_at
from spectool.stats import RunStats
from spectool.timing import PhaseTimer
from spectool.trace.recorder import PackedRows, Recorder, pack_rows
from spectool.trace.select import Record
from spectool.verify import (
    VerifyResult,
    commit_kv,
    target_probs_at,
    verify_greedy,
    verify_greedy_parts,
    verify_sampling,
    verify_sampling_chunked,
)

# Prompt lengths a prefill is padded to on CUDA, one graph per (batch bucket, length): eagerly a
# prefill launches some thirty kernels per layer, and on a slow host those launches take most of
# its time (a 32-layer target of the 113M shape: 29 ms eager, 3.7 ms graphed, 2.3 ms of kernels).
# From 128 to 1024 tokens they step by 64 up to 512 and by 128 after it, so prompts grouped by
# length pad little: sixteen prompts of 432-674 tokens pad to 9,728 tokens, not 12,288.
PREFILL_LENGTHS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048)
# Most padded tokens (batch bucket x length) a prefill graph takes: as many as an eager forward takes
# (prefill_budget), so long prompts are prefilled in as few forwards graphed as eagerly (sixteen of 600
# tokens in two graphs of eight).
PREFILL_GRAPH_TOKENS = 8192


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    prompt_text: str
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    slot: int = -1
    seq_len: int = 0
    finish_reason: str | None = None
    # prompt + output, grown in place (a Batch's histories point at these lists, not copies)
    history: list[int] = field(default_factory=list)


@dataclass
class StepEvent:
    """What one iteration produced (``Engine.stream`` yields one per iteration).

    ``new_tokens[rid]`` are the accepted draft tokens in depth order followed by the
    bonus token (truncated at a stop token or max_new_tokens); ``records`` are the
    recorder's rows for this iteration when recording. ``prefill_tokens[rid]`` is the
    first output token of each request prefilled since the previous event (it comes
    before that request's ``new_tokens``).
    """

    iteration: int
    new_tokens: dict[int, list[int]]
    accept_lengths: dict[int, int]
    records: list
    finished: list[int]
    stats: dict
    prefill_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class GenerateResult:
    """Output of ``Engine.generate``: tokens and text per prompt, stats, trace."""

    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    stats: RunStats
    trace: object | None = None


class Engine:
    """Speculative decoding over a loaded target.

    Args:
        target: what ``spectool.load`` returned.
        draft: NgramConfig, EagleConfig, MultiLayerEagleConfig, Eagle3Config, DraftModelConfig, or None
            for plain decoding.
        max_batch_size: requests decoded together; more prompts wait for a free slot.
        max_seq_len: longest prompt + output per request; the KV cache is allocated
            once for max_batch_size × max_seq_len (plus room for one draft tree).
        cuda_graphs: capture and replay the per-iteration forwards on CUDA.
        record_topk: how many of the target's top tokens to record per node.
        deterministic: the target's and the draft layers' forwards use batch-invariant kernels on
            CUDA, so a token's logits are the same bits in a prefill, a decode or a tree verify at
            any batch size, greedy speculative output equals plain greedy output in any dtype (a
            difference is a bug), and so is a draft wherever it is computed. On the CPU it changes
            nothing (float32 there is exact already). See docs/INTERNALS.md, "Deterministic mode".
    """

    def __init__(self, target, draft: DraftConfig | None = None, max_batch_size: int = 8,
                 max_seq_len: int = 4096, cuda_graphs: bool = True, record_topk: int = 5,
                 deterministic: bool = False) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.target = target
        self.model = target.model
        self.config = target.config
        self.device = torch.device(target.device)
        self.draft_config = draft
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.record_topk = record_topk
        self.deterministic = bool(deterministic)
        self.prefill_budget = 8192  # padded tokens per prefill forward
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.tp = getattr(target, "tp", None)  # this rank's place when the target is split (drafters read it)
        self._pads_prefill = self.device.type == "cuda" and self.tp is None  # see prefill_length
        self.drafter = make_drafter(draft, self)
        # The target layers whose outputs the drafter reads in place of the last hidden state (EAGLE-3).
        self.aux_layers: tuple[int, ...] | None = getattr(self.drafter, "aux_layers", None)
        self.num_draft_tokens = self.drafter.num_draft_tokens if self.drafter else 1
        self.method = draft.method if draft is not None else "none"
        # One spare slot past the last request slot: padded graph rows write there.
        self.num_slots = max_batch_size + 1
        self.cache_len = max_seq_len + self.num_draft_tokens
        self._prefill_lengths = self._padded_lengths()
        from spectool.model.kv_cache import KVCache

        # Under tensor parallelism the cache holds this rank's KV heads (local_config).
        self.cache = KVCache.for_model(self.model.local_config, self.num_slots, self.cache_len, target.dtype,
                                       self.device)
        # On CUDA the attention kernel reads the live lengths on the device (graph safe);
        # the CPU path slices the cache to a host-known length instead.
        self.on_cuda = self.device.type == "cuda"
        self._kv_len: int | None = None
        self.graph_buckets = graph_buckets(max_batch_size)
        scratch = {"slots": max_batch_size}  # padded graph rows write only to the spare slot
        self._greedy_runner = GraphRunner(self._greedy_step, self.graph_buckets, self.cuda_graphs, scratch)
        # With record=True the greedy graph also packs the iteration's trace fields (see _greedy_step).
        self._greedy_record_runner = GraphRunner(functools.partial(self._greedy_step, record=True),
                                                 self.graph_buckets, self.cuda_graphs, scratch)
        # The prompt's forward and its last positions' logits, per (batch bucket, padded length).
        self._prefill_runner = GraphRunner(self._prefill_step, self.graph_buckets, self.cuda_graphs, scratch)
        # Per (mode, tree size N): the verify graph's packed trace layout (mode "greedy" or "sampling").
        self._record_layouts: dict[tuple[str, int], list] = {}
        self._root_scores: dict[int, torch.Tensor] = {}  # per batch size: plain decoding's tree scores
        # Sampling: one runner per (top_k, top_p, record), temperature a per-row input (_sampling_step).
        self._sampling_runners: dict[tuple[int, float, bool], GraphRunner] = {}
        self._temperatures: dict[tuple[int, float], torch.Tensor] = {}
        # The sampling coins' key (kernels/sampling.py): the call's seed and a nonce per cache slot,
        # the id of the request in it; the graphed step reads both at fixed addresses.
        self._sample_seed = torch.zeros(1, dtype=torch.long, device=self.device)
        self._slot_nonce = torch.zeros(self.num_slots, dtype=torch.long, device=self.device)
        if self.drafter is not None:
            self.drafter.allocate()
        self._stop = threading.Event()
        # The verify's host table: pinned copies per shape, and the event behind the last copy.
        self._pinned_tables: dict[torch.Size, torch.Tensor] = {}
        self._table_copied = torch.cuda.Event() if self.on_cuda else None
        # (batch, tree, why) of a draft made at the end of the last iteration for the next one.
        self._next_draft: tuple[Batch, DraftTree | MaskTree, dict] | None = None
        self._both_tree_sizes: set[tuple[int, int]] = set()  # (runner id, bucket): see _capture_other_size

    # ----------------------------------------------------------------- public API

    def request_stop(self) -> None:
        """Ask a running ``generate``/``stream`` to stop after the current iteration (thread-safe)."""
        self._stop.set()

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 record: bool | Record = True, stop_token_ids: Sequence[int] | None = None,
                 ignore_eos: bool = False, progress: bool = False) -> GenerateResult:
        """Decode every prompt to completion; see ``stream`` for the arguments."""
        state: dict = {}
        for _ in self.stream(prompts, max_new_tokens, temperature, top_k, top_p, seed, record,
                             stop_token_ids, ignore_eos, progress, _state=state):
            pass
        reqs: list[_Request] = state["requests"]
        return GenerateResult(
            token_ids=[r.output for r in reqs],
            texts=[self._decode(r.output) for r in reqs],
            finish_reasons=[r.finish_reason or "aborted" for r in reqs],
            stats=state["stats"],
            trace=state.get("trace"),
        )

    @torch.no_grad()
    def stream(self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 256,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               record: bool | Record = True, stop_token_ids: Sequence[int] | None = None,
               ignore_eos: bool = False, progress: bool = False, _state: dict | None = None,
               ) -> Iterator[StepEvent]:
        """Decode and yield one ``StepEvent`` per iteration.

        Args:
            prompts: strings (encoded with the target's tokenizer) or token-id lists.
            max_new_tokens: tokens to generate per request (the first comes from prefill).
            temperature: 0 for greedy; otherwise sampling, exactly lossless.
            top_k, top_p: applied to the target distribution before sampling (0 / 1.0 = off).
            seed: seeds the sampling generator; equal seeds give equal outputs.
            record: keep a Trace of every iteration (``result.trace``), or of the part that a
                ``st.Record(every=..., requests=..., where=..., slowest=...)`` selects; with
                ``st.Record(path=...)`` the trace goes to that file as the run goes (bounded memory).
            stop_token_ids: tokens that finish a request (default: the model's eos ids).
            ignore_eos: never stop at a stop token (benchmarks).
            progress: show a progress bar of generated tokens.

        With ``record=True`` each event's ``records`` holds that iteration's rows as
        ``IterationView`` objects. While the stream runs (suspended between events included), the
        objects that existed before it are left out of Python's cycle collection (``gc.freeze``),
        so no full collection pauses an iteration; they are collected again once it ends or is closed.
        """
        self._validate_sampling(max_new_tokens, temperature, top_k, top_p)
        requests = [self._make_request(i, p, max_new_tokens) for i, p in enumerate(prompts)]
        stops = set() if ignore_eos else set(stop_token_ids if stop_token_ids is not None
                                             else self.target.eos_token_ids)
        sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self._sample_seed.fill_(int(seed) % 2**32)
        stats = RunStats(method=self.method)
        # Every rank of a split target takes the same decisions; rank 0 alone records them.
        recorder = (self._make_recorder(sampling, seed, record) if record and (self.tp is None or self.tp.rank == 0)
                    else None)
        state = _state if _state is not None else {}
        state.update(requests=requests, stats=stats)
        self._stop.clear()
        bar = _progress_bar(progress, total=max_new_tokens * len(requests))

        waiting = deque(requests)
        running: list[_Request] = []
        free_slots = list(range(self.max_batch_size))
        timer = PhaseTimer(self.device)
        graphs_before = self.graph_stats()
        started = time.perf_counter()
        iteration = 0
        prefilled: dict[int, int] = {}  # first tokens not yet reported in an event
        batch = lens_roots = None  # the running batch, rebuilt only when requests join or leave
        self._next_draft = None
        # Whatever exists before the call (the model, the caller's notebook) is set aside from the
        # cycle collector while it runs, so a full collection scans only what the call makes: with
        # transformers imported a full scan took 130 ms on the CPU, a pause inside some iteration
        # that both the decode and end-to-end figures of a 150 ms call feel.
        gc.freeze()
        try:
            while waiting or running:
                if self._stop.is_set():
                    break
                admitted = []
                while waiting and free_slots:
                    req = waiting.popleft()
                    req.slot = free_slots.pop(0)
                    admitted.append(req)
                if admitted:
                    prefill_began = time.perf_counter()
                    self._prefill(admitted, sampling, generator, stats)
                    stats.add_prefill(prefill_began - started, time.perf_counter() - prefill_began)
                    prefilled.update({req.request_id: req.output[0] for req in admitted})
                    for req in admitted:
                        bar.update(1)
                        if self._finish_if_done(req, stops):
                            req.finish_reason = "prefill" if req.finish_reason == "length" else req.finish_reason
                            self._release([req], free_slots, recorder)
                        else:
                            running.append(req)
                    running.sort(key=lambda r: r.slot)
                    batch = None
                if not running:
                    continue
                began = time.perf_counter()
                if batch is None:
                    batch, lens_roots = self._batch(running)
                event = self._iteration(began, iteration, running, batch, lens_roots, sampling, generator, stats,
                                        recorder, bool(record), timer, stops, _state is None)
                if event.finished:
                    done = [r for r in running if r.finish_reason is not None]
                    self._release(done, free_slots, recorder)
                    running = [r for r in running if r.finish_reason is None]
                    batch = None
                stats.elapsed_s = time.perf_counter() - started
                event.stats = {"tokens_per_s": stats.tokens_per_s,
                               "mean_accept_length": stats.mean_accept_length,
                               "iterations": iteration + 1, "elapsed_s": stats.elapsed_s}
                if progress:
                    bar.update(sum(len(t) for t in event.new_tokens.values()))
                event.prefill_tokens, prefilled = prefilled, {}
                iteration += 1
                yield event
        finally:
            gc.unfreeze()
            bar.close()
            for req in requests:
                if req.finish_reason is None:
                    req.finish_reason = "aborted"
            aborted = [r for r in running if r.slot >= 0]
            if aborted:
                self._release(aborted, free_slots, recorder)
            for req in waiting:
                if recorder is not None:
                    recorder.record_request(req.request_id, req.prompt, req.output, req.finish_reason,
                                            prompt_text=req.prompt_text)
            stats.elapsed_s = time.perf_counter() - started
            stats.graphs = {k: v - graphs_before[k] for k, v in self.graph_stats().items()}
            if recorder is not None:
                state["trace"] = recorder.close()

    @torch.no_grad()
    def warmup(self, sampling: bool = True, record: bool = True, top_k: int = 0, top_p: float = 1.0) -> dict:
        """Capture every CUDA graph (and compile every kernel) a ``generate`` call can need, now.

        Graphs are otherwise captured lazily, the first time a batch bucket, tree size or mode
        comes up, each capture costing tens to hundreds of ms inside that call: as requests
        finish at different iterations a batch falls into smaller buckets, so a user's calls
        would pay it again and again. ``warmup`` first prefills dummy prompts of every padded
        prompt length (``PREFILL_LENGTHS`` as far as the cache holds) at every batch bucket, which
        captures the prefill graphs of the target and the drafter, then runs one prefill and one
        iteration of dummy requests per batch bucket (largest first) for greedy decoding and, with
        ``sampling``, for temperature > 0 with the cuts ``top_k`` and ``top_p`` (pass those your calls
        use: each pair has graphs of its own), each with recording off and, with ``record``, on; that
        takes every path of the iteration (N-gram's whole tree and roots alone, both EAGLEs' draft and
        extend graphs). It is harmless: the dummy requests use free cache slots (whatever they
        write there is overwritten before a later request reads it), and a drafter that learns
        on the host (the N-gram trie) is kept from learning their tokens.

        Call it between ``generate`` calls, never while a ``stream`` is suspended. Returns
        ``{"seconds": wall time, "captures": graphs captured}``.
        """
        self._validate_sampling(1, 1.0, top_k, top_p)
        started = time.perf_counter()
        before = self.graph_stats()["captures"]
        cuts = dict(top_k=int(top_k), top_p=float(top_p))
        modes = [(t, r) for t in ((0.0, 1.0) if sampling else (0.0,)) for r in ((False, True) if record else (False,))]
        drafter = self.drafter
        if drafter is not None and drafter.host_accepted:
            self.drafter = _NotLearning(drafter)
        try:
            self._warm_prefills()
            for bucket in reversed(self.graph_buckets):
                for k, (temperature, rec) in enumerate(modes):
                    # Prompt lengths of both kinds Triton specialises a kernel for: a multiple of 16 and not.
                    self._warm_iteration(min(bucket, self.max_batch_size), temperature, rec, (32, 17)[k % 2], cuts)
        finally:
            self.drafter = drafter
            self._next_draft = None
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        return {"seconds": time.perf_counter() - started, "captures": self.graph_stats()["captures"] - before}

    def _warm_prefills(self) -> None:
        """Prefill dummy prompts of every padded length at every batch bucket (``warmup``), capturing the
        prefill graphs of the target and the drafter; they sit in slots 0..b-1, whose K/V later
        prefills overwrite."""
        if not (self.cuda_graphs and self._pads_prefill):
            return
        sampling = dict(temperature=0.0, top_k=0, top_p=1.0)
        generator = torch.Generator(device=self.device).manual_seed(0)
        for t in self._prefill_lengths:
            length = min(t, self.max_seq_len - 1)  # the longest prompt this padded length serves
            for bucket in self.graph_buckets:
                rows = min(bucket, self.max_batch_size)
                if self.prefill_length(rows, length) != (t, True):
                    continue
                reqs = self._dummy_requests(rows, length)
                try:
                    self._prefill(reqs, sampling, generator, RunStats(method=self.method))
                finally:
                    self._release(reqs, [], None)

    def _dummy_requests(self, b: int, length: int) -> list[_Request]:
        """``warmup``'s requests: ``b`` prompts of ``length`` tokens in slots 0..b-1."""
        vocab = self.config.vocab_size
        prompts = [[(7 * i + j) % vocab for j in range(length)] for i in range(b)]
        return [_Request(i, p, "", self.max_seq_len, slot=i, history=list(p)) for i, p in enumerate(prompts)]

    def _warm_iteration(self, b: int, temperature: float, record: bool, length: int, cuts: dict) -> None:
        """Prefill ``b`` dummy requests of ``length`` tokens in slots 0..b-1 and run one iteration (``warmup``);
        ``cuts`` (top_k, top_p) apply when sampling."""
        reqs = self._dummy_requests(b, max(1, min(length, self.max_seq_len - 2)))
        sampling = dict(temperature=temperature, **(cuts if temperature > 0 else dict(top_k=0, top_p=1.0)))
        generator = torch.Generator(device=self.device).manual_seed(0)
        stats = RunStats(method=self.method)
        recorder = self._make_recorder(sampling, 0) if record else None
        self._next_draft = None
        try:
            self._prefill(reqs, sampling, generator, stats)
            batch, lens_roots = self._batch(reqs)
            self._iteration(time.perf_counter(), 0, reqs, batch, lens_roots, sampling, generator, stats, recorder,
                            record, PhaseTimer(self.device), set(), False)
        finally:
            self._next_draft = None
            self._release(reqs, [], recorder)
            if recorder is not None:
                recorder.close()

    # ----------------------------------------------------------------- internals

    def _validate_sampling(self, max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")

    def _make_request(self, index: int, prompt, max_new_tokens: int) -> _Request:
        text, given = (prompt, self.target.encode(prompt)) if isinstance(prompt, str) else ("", prompt)
        ids, bad = _checked_ids(given, self.config.vocab_size)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
        if len(ids) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} > max_seq_len={self.max_seq_len}")
        limit = self.config.max_position_embeddings
        if len(ids) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} positions, more than the model's limit of {limit} "
                "(max_position_embeddings)")
        return _Request(index, ids, text, max_new_tokens, history=list(ids))

    def _decode(self, ids: list[int]) -> str:
        return self.target.decode(ids) if self.target.tokenizer is not None else ""

    def _make_recorder(self, sampling: dict, seed: int, record=True):
        tok = self.target.tokenizer
        run_info = {
            "engine": {"max_batch_size": self.max_batch_size, "max_seq_len": self.max_seq_len,
                       "cuda_graphs": self.cuda_graphs, "record_topk": self.record_topk,
                       "deterministic": self.deterministic,
                       "seed": seed, **sampling},
            "draft": self.draft_config.to_dict() if self.draft_config is not None else {"method": "none"},
            "model": {"name": self.target.name, "hash": self.target.model_hash,
                      "dtype": str(self.target.dtype).replace("torch.", ""),
                      "tp_size": 1 if self.tp is None else self.tp.size},
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.on_cuda else self.device.type,
            "versions": {"spectool": _version(), "torch": torch.__version__},
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(self.drafter.trace_info() if hasattr(self.drafter, "trace_info") else {}),
        }
        # A conversion costs a few ms whatever its size: Record's 1024 rows a batch keep it far below an iteration.
        options = record if isinstance(record, Record) else Record()
        return Recorder(options.path, run_info, tokenizer_json=tok.to_str() if tok is not None else None,
                        flush_every=options.flush_every, select=options)

    def graph_stats(self) -> dict[str, int]:
        """CUDA-graph replays, eager runs and captures of the target steps (and the drafter's)."""
        out = {"replays": 0, "eager": 0, "captures": 0}
        runners = [self._greedy_runner, self._greedy_record_runner, *self._sampling_runners.values()]
        runners += getattr(self.drafter, "graph_runners", [])
        for runner in runners:
            for k in out:
                out[k] += runner.stats[k]
        # The prefills' graphs too (a prompt longer than PREFILL_LENGTHS is prefilled eagerly by design).
        for k in ("replays", "captures"):
            out[k] += self._prefill_runner.stats[k]
        return out

    def _forward_step(self, tokens, positions, slots, starts, mask, gather: bool = True):
        """Target forward over a tree (or one token): the hidden states the drafter reads (the last
        layer's, or the concatenated ``aux_layers``' outputs) and float32 logits (under tensor
        parallelism with ``gather=False``, this rank's vocabulary slice)."""
        hidden, feed = self._forward_hidden(tokens, positions, slots, starts, mask)
        return feed, self.model.logits(hidden, deterministic=self.deterministic, gather=gather)

    def _forward_hidden(self, tokens, positions, slots, starts, mask):
        """Target forward: (the last layer's hidden states, what the drafter reads: those again or the
        concatenated ``aux_layers``' outputs)."""
        if self.aux_layers is None:
            hidden = self.model(tokens, positions, cache=self.cache, slots=slots, starts=starts, tree_mask=mask,
                                kv_len=self._kv_len, deterministic=self.deterministic)
            return hidden, hidden
        return self.model(tokens, positions, cache=self.cache, slots=slots, starts=starts, tree_mask=mask,
                          kv_len=self._kv_len, aux_layers=self.aux_layers, deterministic=self.deterministic)

    def _prefill_step(self, tokens, slots, last):
        """Forward of right-padded prompts [B, T] from cache index 0 (``_kv_len`` = T): the float32 logits
        [B, 1, V] at each row's last prompt position ``last``, then what the drafter reads (left out
        when the drafter reads no hidden states, so no [B, T, H] output is kept)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        starts = torch.zeros(b, dtype=torch.long, device=tokens.device)
        hidden, feed = self._forward_hidden(tokens, positions, slots, starts, None)
        logits = self.model.logits(positions_at(hidden, last), deterministic=self.deterministic, gather=False)
        reads_hidden = self.drafter is not None and getattr(self.drafter, "reads_hidden", True)
        return (logits, feed) if reads_hidden else (logits,)

    def prefill_length(self, rows: int, longest: int) -> tuple[int, bool]:
        """(padded length, whether a graph runs it) of a prefill forward of ``rows`` prompts, the longest
        ``longest`` tokens (the drafters pad their own prefills the same way): on CUDA the shortest of the
        engine's padded lengths (``PREFILL_LENGTHS`` up to what its cache holds, then that limit) that
        holds it, when the group fits a prefill graph (eager CUDA pads the same way, so eager and
        graphed runs compute the same shapes); else ``longest``, eagerly."""
        t = self._padded_length(longest)
        if t is None or self._prefill_runner.bucket_for(rows) * t > PREFILL_GRAPH_TOKENS:
            return longest, False
        return t, True

    def _padded_length(self, longest: int) -> int | None:
        """The padded length a prompt of ``longest`` tokens takes on CUDA, None where none does (the CPU,
        a split target, a prompt past every padded length)."""
        if not self._pads_prefill:
            return None
        i = bisect.bisect_left(self._prefill_lengths, longest)
        return self._prefill_lengths[i] if i < len(self._prefill_lengths) else None

    def _padded_lengths(self) -> tuple[int, ...]:
        """The lengths this engine pads a prefill to: PREFILL_LENGTHS up to what the cache holds and the
        model's positions take with a tree after the prompt, then that limit itself when it is below the
        longest of them (a cache of 700 tokens pads a 600-token prompt to 700, not 768 it has no room
        for)."""
        limit = min(self.max_seq_len, self.model.rope.max_position - self.num_draft_tokens - 2)
        lengths = [t for t in PREFILL_LENGTHS if t <= limit]
        if (lengths[-1] if lengths else 0) < limit < PREFILL_LENGTHS[-1]:
            lengths.append(limit)
        return tuple(lengths)

    def _prefill_groups(self, reqs: list[_Request]) -> list[list[_Request]]:
        """Requests in prefill groups, each one forward (``prefill_groups``: by length, the fewest padded
        tokens): prompts a padded length serves in groups that fit a prefill graph
        (PREFILL_GRAPH_TOKENS, counted as the graph pads them), longer ones in groups of
        ``prefill_budget`` tokens."""
        def cost(rows: int, longest: int) -> int | None:
            t, graphed = self.prefill_length(rows, longest)
            if graphed:  # a graph's rows pad to its batch bucket
                return (self._prefill_runner.bucket_for(rows) if self.cuda_graphs else rows) * t
            if self._padded_length(longest) is None and rows * longest <= self.prefill_budget:
                return rows * longest
            return None

        groups = prefill_groups([len(r.prompt) for r in reqs], self.prefill_budget, cost)
        return [[reqs[i] for i in g] for g in groups]

    def _verify_greedy(self, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        """Greedy verify against the whole logits, or under tensor parallelism against this rank's
        vocabulary slice: only every rank's best logit and its id are exchanged, never the logits."""
        if self.tp is None:
            return verify_greedy(tree, logits)
        return verify_greedy_parts(tree, *self.tp.argmax_parts(logits))

    def _target_topk(self, logits: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded target top-k of a greedy step (ids led by the verifier's argmax) and their
        probabilities; under tensor parallelism from the vocabulary slices (``TensorParallel.topk``,
        whose ties go to the lowest id, as the verifier's)."""
        k = min(self.record_topk, self.config.vocab_size)
        if self.tp is not None:
            top_p, top_i = self.tp.topk(logits, k, softmax=True)
            # Only NaN logits part the two (the verifier counts NaN as the largest, the top-k as -inf):
            # the trace's argmax is its top-1, so it leads, with no probability known for it.
            led = _led_by(top_i, argmax)
            return led, torch.where(led == top_i, top_p, float("nan"))
        top_i = _led_by(logits.topk(k, dim=-1).indices, argmax)
        # One fused softmax and a gather: logsumexp alone is about nine kernels.
        return top_i, torch.softmax(logits, dim=-1).gather(-1, top_i)

    def _greedy_step(self, slots, record: bool = False, **inputs):
        """Forward, greedy verify and KV commit in one (graph-captured) step.

        ``inputs`` are the tree's tensors, a MaskTree's (the tree is then completed here), or for
        plain decoding ``roots`` and ``seq_lens`` (the one-node tree is then made here): inside
        the graph, building a tree costs the host no launches.

        With ``record`` the step also packs the iteration's per-request trace fields into one
        [B, R] byte table (its layout kept in ``_record_layouts``), so recording costs the
        engine's thread one copy instead of a softmax, a top-k and a pack per field.
        Running it twice on the same inputs gives the same cache: the forward rewrites
        the tree's K/V before the commit moves them, so graph warm-up is harmless.
        It also makes the table the engine's host sync reads (``_host_table``), so no op runs
        between the replay and the sync.
        """
        tree = self._step_tree(inputs)
        hidden, logits = self._forward_step(tree.tokens, tree.positions, slots, tree.seq_lens, tree.mask,
                                            gather=False)
        res = self._verify_greedy(tree, logits)
        moved, out = self._commit(tree, res, hidden, slots, record)
        if not record:
            return out
        top_i, top_p = self._target_topk(logits, res.target_argmax)
        packed = pack_rows(_record_tensors(tree, res, top_i, top_p, moved))
        # Top-k and accept-path width follow from N; one layout object per N lets the recorder check it once.
        self._record_layouts.setdefault(("greedy", tree.num_nodes), packed.layout)
        return (*out, packed.data)

    def _commit(self, tree: DraftTree, res: VerifyResult, hidden: torch.Tensor, slots: torch.Tensor,
                record: bool) -> tuple:
        """The KV commit of a verify step (the rows it moved when recording) and the step's outputs
        before any trace fields, shared by the greedy and the sampling step."""
        moved = None
        if tree.num_nodes > 1:
            moved = commit_kv(self.cache.k, self.cache.v, slots, tree.seq_lens, res.accept_path, res.accept_length,
                              rows=record)
        return moved, (hidden, res.status, res.accept_path, res.accept_length, res.bonus, res.target_argmax,
                       res.coins, _host_table(tree, res))

    def _step_tree(self, inputs: dict) -> DraftTree:
        """The tree of a verify step's inputs: a tree's tensors, a MaskTree's (completed here), or
        ``roots`` and ``seq_lens`` (plain decoding's one-node tree, made here)."""
        if "roots" in inputs:
            return self._root_tree(inputs["roots"], inputs["seq_lens"])
        if "positions" not in inputs:
            return MaskTree(**inputs, max_depth=inputs["tokens"].shape[1] - 1).build()
        return DraftTree(**inputs, max_depth=inputs["tokens"].shape[1] - 1)

    def _sampling_step(self, slots, temperature, top_k: int, top_p: float, record: bool = False, **inputs):
        """Forward, lossless sampling verify and KV commit in one (graph-captured) step; the same
        outputs as ``_greedy_step``. ``temperature`` is a [B] input, so one graph serves every
        temperature; ``top_k`` and ``top_p`` are fixed per runner (``_sampling_runner``).

        The coins come from ``sampling_coins``: counter-based Philox keyed by the call's seed and
        each slot's request, at the row's seq_len, so replays need no generator state and graph
        warm-up runs (which draw the same coins) change nothing.
        """
        tree = self._step_tree(inputs)
        # The whole distribution: under tensor parallelism the logits are joined (one all-gather).
        hidden, logits = self._forward_step(tree.tokens, tree.positions, slots, tree.seq_lens, tree.mask)
        coins = sampling_coins(self._sample_seed, self._slot_nonce[slots], tree.seq_lens, tree.num_nodes)
        if logits.is_cuda or triton_on_cpu():
            # Never makes the [B, N, V] probabilities: every vocabulary pass is split over (row, chunk)
            # programs, and the cuts come from a few candidates per row; what a trace records is read
            # from its rows (``_pack_sampling_record``). Top-p over a flat row, whose candidates overflow
            # the buffer, narrows the range over the row first: 0.68 ms at bs 1 and 4.4 ms at bs 64 on an
            # H100, against 0.87 and 19.0 ms for the torch verify.
            res = verify_sampling_chunked(tree, logits, temperature, top_k, top_p, coins)
        else:
            res = verify_sampling(tree, logits, temperature, top_k, top_p, None, coins)
        moved, out = self._commit(tree, res, hidden, slots, record)
        if not record:
            return out
        packed = self._pack_sampling_record(tree, res, moved, logits, temperature)
        self._record_layouts.setdefault(("sampling", tree.num_nodes), packed.layout)
        return (*out, packed.data)

    def _sampling_runner(self, top_k: int, top_p: float, record: bool) -> GraphRunner:
        key = (top_k, top_p, record)
        if key not in self._sampling_runners:
            step = functools.partial(self._sampling_step, top_k=top_k, top_p=top_p, record=record)
            self._sampling_runners[key] = GraphRunner(step, self.graph_buckets, self.cuda_graphs,
                                                      {"slots": self.max_batch_size, "temperature": 1.0})
        return self._sampling_runners[key]

    def _temperature_input(self, b: int, temperature: float) -> torch.Tensor:
        """The sampling step's [b] temperature input, made once per (b, temperature), so a replay
        finds it unchanged and copies nothing."""
        key = (b, temperature)
        if key not in self._temperatures:
            self._temperatures[key] = torch.full((b,), temperature, dtype=torch.float32, device=self.device)
        return self._temperatures[key]

    def _prefill(self, reqs: list[_Request], sampling: dict, generator, stats: RunStats) -> None:
        """Prefill new requests (right-padded into groups) and sample each one's first token.

        Padding is harmless: a short row's pad tokens land past its prompt in the cache,
        where later writes overwrite them before anything reads them.
        """
        on_admit = getattr(self.drafter, "on_admit", None)  # host work that can overlap the prefill
        if on_admit is not None:
            on_admit([r.request_id for r in reqs], [r.prompt for r in reqs])
        # A drafter that works on the device is fed before the host reads the first tokens, so its
        # prefill runs on the GPU straight after the target's (after the read, it cost EAGLE's prefill
        # a host round trip and its own launches while the GPU idled); the N-gram trie after it.
        learns_on_host = self.drafter is not None and self.drafter.host_accepted
        groups = self._prefill_groups(reqs)
        launched = []
        for g, group in enumerate(groups):
            lens = [len(r.prompt) for r in group]
            t, graphed = self.prefill_length(len(group), max(lens))
            dev = self.device
            tokens = self._on_device([r.prompt + [0] * (t - len(r.prompt)) for r in group])
            slots = self._on_device([r.slot for r in group])
            self._slot_nonce[slots] = self._on_device([r.request_id % 2**31 for r in group])
            last = self._on_device(lens) - 1
            self._kv_len = t  # prompts are longer than the graphed attention takes: read t keys
            step = functools.partial(self._prefill_runner, len(group)) if graphed else self._prefill_step
            logits, *feed = step(tokens=tokens, slots=slots, last=last)
            rows = torch.arange(len(group), device=dev)
            res = self._verify(self._root_tree(tokens[rows, last], last), logits, sampling, generator)
            prefill = Prefill([r.request_id for r in group], slots, tokens, res.bonus, lens, last,
                              feed[0] if feed else None, graphed, [r.history for r in group],
                              last_group=g == len(groups) - 1)
            # Group by group: a prefill graph's outputs are rewritten by its next replay.
            if self.drafter is not None and not learns_on_host:
                with self._drafting():
                    self.drafter.on_prefill(prefill)
            launched.append((group, prefill))
        # One host read of every group's first tokens, once the last group is launched: a read per
        # group kept each next group's launch waiting until the GPU had finished the one before.
        firsts = iter(torch.cat([prefill.first for _, prefill in launched]).tolist())
        for group, prefill in launched:
            for req, first, n in zip(group, firsts, prefill.lens):
                req.output.append(first)
                req.history.append(first)
                req.seq_len = n
            stats.prefill_tokens += sum(prefill.lens)
            stats.generated_tokens += len(group)
            if learns_on_host:
                self.drafter.on_prefill(prefill)

    def _drafting(self):
        """The context of the drafter's forwards: in deterministic mode the batch-invariant kernels too,
        so a draft is the same bits at any batch and in any forward that computes it (what the what-if
        tuner's teacher-forced replay of a deterministic trace relies on)."""
        return ops.deterministic() if self.deterministic else contextlib.nullcontext()

    def _batch(self, reqs: list[_Request]) -> tuple[Batch, torch.Tensor]:
        """The requests as a Batch, and the [2, B] device tensor whose rows are its seq_lens and roots.

        The running batch is built only when requests join or leave (one host-to-device copy);
        in between, ``_iteration`` advances it in place: the state tensor from the verify step's
        output, histories (the requests' own lists) and seq_lens_host as it goes.
        """
        lens_roots = self._on_device([[r.seq_len for r in reqs], [r.output[-1] for r in reqs]])
        # slots is a tensor of its own: a view of lens_roots would share its version counter, and
        # every advance would make the graph runners copy the unchanged slots again.
        slots = self._on_device([r.slot for r in reqs])
        batch = Batch(request_ids=[r.request_id for r in reqs], slots=slots, seq_lens=lens_roots[0],
                      roots=lens_roots[1], histories=[r.history for r in reqs], seq_lens_host=[r.seq_len for r in reqs])
        return batch, lens_roots

    def _on_device(self, values: list) -> torch.Tensor:
        """An int64 tensor of ``values`` on the engine's device, without a host sync on CUDA: a copy
        from pageable memory waits for the stream, i.e. for the draft the GPU may still be running
        when the batch changes; from pinned memory it is queued behind it."""
        host = torch.tensor(values, dtype=torch.long)
        if not self.on_cuda:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _root_tree(self, roots: torch.Tensor, seq_lens: torch.Tensor) -> DraftTree:
        """The one-node tree of plain decoding (and of the first token after prefill). Its
        all-ones scores are made once per batch size, so a graph replay need not copy them."""
        ones = self._root_scores.get(roots.shape[0])
        if ones is None:
            ones = self._root_scores[roots.shape[0]] = torch.ones(roots.shape[0], 1, device=self.device)
        return chain_tree(roots[:, None], ones, seq_lens)

    def _verify(self, tree: DraftTree, logits: torch.Tensor, sampling: dict, generator):
        """The first token's decision after a prefill; ``logits`` are this rank's vocabulary slice
        under tensor parallelism (sampling joins the prompts' last rows alone)."""
        if sampling["temperature"] == 0.0:
            return self._verify_greedy(tree, logits)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        return verify_sampling(tree, logits, sampling["temperature"], sampling["top_k"], sampling["top_p"],
                               generator)

    def _iteration(self, began: float, iteration: int, running: list[_Request], batch: Batch,
                   lens_roots: torch.Tensor, sampling: dict, generator, stats: RunStats, recorder, record: bool,
                   timer: PhaseTimer, stops: set[int], live_records: bool) -> StepEvent:
        """One draft + verify + accept cycle; ``began`` is when its host work started and
        ``lens_roots`` the [2, B] tensor behind ``batch.seq_lens`` and ``batch.roots``. Under
        tensor parallelism every rank runs the recording step when the run records (its top-k
        takes part in a collective), and rank 0 alone has a ``recorder``.

        Its steps in order: draft (and index), verify (and commit), record, feed the drafter
        around the host sync, advance the requests, draft the next iteration early. Greedy and
        sampling differ only in the verify step object (``_verify_step``); drafters that work on
        the device or on the host differ only in when ``_feed_drafter`` calls them.
        """
        step = self._verify_step(sampling, record)
        tree, why = self._draft_tree(batch, step, timer)
        n = 1 if tree is None else tree.tokens.shape[1]
        self._kv_len = None if self.on_cuda else max(batch.seq_lens_host) + n
        verified = step.verify(batch, tree, timer)
        # What runs from here on feeds the next iteration's draft and is timed into it: waiting for
        # the draft-extend here would idle the GPU between iterations.
        timer.end_iteration()
        rows = self._table_to_host(verified.table)
        if recorder is not None:
            # Before the host sync below, so on CUDA this host work overlaps the step on the GPU; and
            # before on_verify, whose graphs may rewrite the tree's and the draft's static buffers.
            recorder.record_batch({"iteration": iteration, "method": self.method,
                                   "temperature": sampling["temperature"],
                                   "request_id": np.asarray(batch.request_ids, dtype=np.int32),
                                   "num_nodes": n, **why}, verified.packed())
        host, accepted = self._feed_drafter(batch, verified, lens_roots, rows, timer)
        event, accept_lengths = self._advance(iteration, running, batch, host, accepted, stops, stats)
        if self.drafter is not None and not event.finished and not self._stop.is_set():
            # The batch stays as it is, so its next draft can start now: on the GPU it then runs
            # while this thread reads the timings, updates the stats and yields the event.
            with timer("draft"):
                self._next_draft = (batch, *self._draft(batch, timer))
        timings = timer.micros()
        timings["iteration_us"] = (time.perf_counter() - began) * 1e6
        stats.add_iteration(iteration, batch.request_ids, accept_lengths, [row[3] for row in host], timings)
        if recorder is not None:
            recorder.record_timings(timings)
            if live_records:
                event.records = recorder.iteration_rows()
        return event

    def _verify_step(self, sampling: dict, recording: bool) -> _GreedyVerify | _SamplingVerify:
        """How this iteration verifies: the one place where greedy and sampling part ways."""
        if sampling["temperature"] == 0.0:
            return _GreedyVerify(self, recording)
        return _SamplingVerify(self, recording, sampling)

    def _draft_tree(self, batch: Batch, step: _GreedyVerify | _SamplingVerify,
                    timer: PhaseTimer) -> tuple[DraftTree | MaskTree | None, dict]:
        """The iteration's tree, drafted at the end of the last iteration or now, made ready for
        ``step``; None for plain decoding, whose one-node tree the verify graph makes."""
        drafted, self._next_draft = self._next_draft, None
        if self.drafter is None:
            return None, {}
        if drafted is not None and drafted[0] is batch:
            tree, why = drafted[1:]
        else:
            with timer("draft"):
                tree, why = self._draft(batch, timer)
        if isinstance(tree, MaskTree):
            self._capture_other_size(step.runner, tree, batch, step.extra_inputs(batch))
        return step.prepare(tree, timer), why

    def _feed_drafter(self, batch: Batch, verified: _Verified, lens_roots: torch.Tensor,
                      rows: Callable[[], list[list[int]]], timer: PhaseTimer,
                      ) -> tuple[list[list[int]], list[list[int]]]:
        """Wait for the verify's host table (the iteration's one host sync: the engine needs the
        accepted tokens to stop requests) and feed the drafter the verify's outcome. A drafter that
        works on the device alone is fed before the sync, so the GPU goes on from the verify to its
        draft-extend; one that needs the accepted tokens on the host, after it. Returns the table's
        rows and the tokens each row gained (accepted drafts, then the bonus)."""
        on_device = self.drafter is not None and not self.drafter.host_accepted
        if on_device:
            self._after_verify(batch, verified, None, lens_roots, timer)
        host = rows()
        # Row b: next seq_len, bonus, accept length a, the tree's depth, then the tokens along the
        # accepted path (root first), so row[5:5 + a] are the accepted drafts.
        accepted = [row[5:5 + row[2]] + [row[1]] for row in host]
        if not on_device:
            self._after_verify(batch, verified, accepted, lens_roots, timer)
        return host, accepted

    def _advance(self, iteration: int, running: list[_Request], batch: Batch, host: list[list[int]],
                 accepted: list[list[int]], stops: set[int], stats: RunStats) -> tuple[StepEvent, list[int]]:
        """Move every request on by what it gained: its host length, output and finish reason."""
        event = StepEvent(iteration, {}, {}, [], [], {})
        accept_lengths = []
        for i, (req, row, gained) in enumerate(zip(running, host, accepted)):
            a = row[2]
            accept_lengths.append(a)
            req.seq_len += a + 1
            batch.seq_lens_host[i] = req.seq_len
            new = self._append_output(req, gained, stops)
            stats.generated_tokens += len(new)
            event.new_tokens[req.request_id] = new
            event.accept_lengths[req.request_id] = a
            if req.finish_reason is not None:
                event.finished.append(req.request_id)
        return event, accept_lengths

    def _capture_other_size(self, runner: GraphRunner, tree: MaskTree, batch: Batch, extra: dict) -> None:
        """Capture now the graph of the other size an N-gram tree can take in this bucket.

        An N-gram iteration verifies its whole tree, or the roots alone when no row matched, so
        each bucket has two graphs. Captured lazily, the second one would stall decoding the
        first time its case comes up, mid-stream (tens of ms: a visible pause in a notebook, an
        outlier inside any timing). Capturing it beside the first costs nothing later. It is
        harmless: it runs before this iteration's verify, whose tree starts at the same cache
        position, and it writes K/V only there (the roots, rewritten by that verify) and past
        it (padding); padding is never accepted, so its commit moves nothing. ``extra`` holds
        the step's other inputs (the sampling step's temperatures).
        """
        if not self.cuda_graphs:
            return
        b = len(batch.request_ids)
        key = (id(runner), runner.bucket_for(b) or 0)
        if key[1] == 0 or key in self._both_tree_sizes:  # 0: past the largest bucket, eager
            return
        self._both_tree_sizes.add(key)
        other = _roots_alone(tree) if tree.tokens.shape[1] > 1 else _roots_and_padding(tree, self.num_draft_tokens)
        runner.capture(b, slots=batch.slots, **extra, **other.as_inputs())

    def _table_to_host(self, table: torch.Tensor) -> Callable[[], list[list[int]]]:
        """Start copying the verify's host table off the device; the returned function waits for
        the copy alone and gives its rows. On CUDA the copy goes to pinned memory behind an event,
        so work launched after it (the draft-extend) is not waited for, as a blocking copy would."""
        if not self.on_cuda:
            return table.tolist
        pinned = self._pinned_tables.get(table.shape)
        if pinned is None:
            pinned = self._pinned_tables[table.shape] = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
        pinned.copy_(table, non_blocking=True)
        self._table_copied.record()

        def rows() -> list[list[int]]:
            self._table_copied.synchronize()
            return pinned.tolist()
        return rows

    def _draft(self, batch: Batch, timer: PhaseTimer) -> tuple[DraftTree | MaskTree, dict]:
        if self.drafter is None:
            return self._root_tree(batch.roots, batch.seq_lens), {}
        with self._drafting():
            return self.drafter.draft(batch, timer)

    def _after_verify(self, batch: Batch, verified: _Verified, accepted: list[list[int]] | None,
                      lens_roots: torch.Tensor, timer: PhaseTimer) -> None:
        """The drafter's on_verify, then the running batch's seq_lens and roots move on to the next
        iteration (after on_verify, which reads the old ones)."""
        if self.drafter is not None:
            with self._drafting():
                self.drafter.on_verify(batch, verified.tree, verified.result, verified.hidden, accepted, timer)
        lens_roots.copy_(verified.table[:, :2].T)

    def _append_output(self, req: _Request, new: list[int], stops: set[int]) -> list[int]:
        """Append what fits before max_new_tokens, up to and including a stop token; returns it."""
        room = req.max_new_tokens - len(req.output)
        kept = new if len(new) <= room else new[:room]
        if stops and not stops.isdisjoint(kept):
            kept = kept[:next(i for i, tok in enumerate(kept) if tok in stops) + 1]
            req.finish_reason = "stop"
        req.output.extend(kept)
        req.history.extend(kept)
        if req.finish_reason is None and len(req.output) >= req.max_new_tokens:
            req.finish_reason = "length"
        return kept

    def _finish_if_done(self, req: _Request, stops: set[int]) -> bool:
        if req.output[-1] in stops:
            req.finish_reason = "stop"
        elif len(req.output) >= req.max_new_tokens:
            req.finish_reason = "length"
        return req.finish_reason is not None

    def _release(self, reqs: list[_Request], free_slots: list[int], recorder) -> None:
        if self.drafter is not None:
            self.drafter.release([r.request_id for r in reqs])
        for req in reqs:
            if recorder is not None:
                recorder.record_request(req.request_id, req.prompt, req.output, req.finish_reason,
                                        prompt_text=req.prompt_text)
            free_slots.append(req.slot)
            req.slot = -1
        free_slots.sort()

    def _pack_sampling_record(self, tree: DraftTree, res: VerifyResult, moved=None, logits=None,
                              temperature=None) -> PackedRows:
        """The trace fields of a sampling iteration (packed inside its verify step); the top-k is
        of the distribution it drew from (after temperature, top-k and top-p). Without the [B, N, V]
        probabilities (the chunked verify) it is the top-k of the logits, which rank the kept tokens
        the same way, with their probabilities read from the verify's rows."""
        if res.target_probs is None:
            k = min(self.record_topk, logits.shape[-1])
            top_i = _led_by(logits.topk(k, dim=-1).indices, res.target_argmax)
            top_p = target_probs_at(logits, temperature, res.target_rows, top_i)
        else:
            k = min(self.record_topk, res.target_probs.shape[-1])
            top_i = _led_by(res.target_probs.topk(k, dim=-1).indices, res.target_argmax)
            top_p = res.target_probs.gather(-1, top_i)
        return pack_rows([*_record_tensors(tree, res, top_i, top_p, moved), ("coins", res.coins),
                          ("child_probs", res.child_probs), ("bonus_cdf", res.bonus_cdf)])


@dataclass
class _Verified:
    """What a verify step produced: the tree as verified, the target's hidden states for the
    drafter, the decision, the host table (``_host_table``) and the iteration's trace fields
    (``packed()``, called only when recording)."""

    tree: DraftTree | MaskTree | None
    hidden: torch.Tensor
    result: VerifyResult
    table: torch.Tensor
    packed: Callable[[], PackedRows]


class _GreedyVerify:
    """Greedy: forward, verify and KV commit in one graphed step (``Engine._greedy_step``); a
    MaskTree is completed and, when recording, the trace fields packed inside it."""

    greedy = True
    kind = "greedy"  # the key of its packed trace layout in Engine._record_layouts

    def __init__(self, engine: Engine, recording: bool) -> None:
        self.engine, self.recording = engine, recording

    @property
    def runner(self) -> GraphRunner:
        e = self.engine
        return e._greedy_record_runner if self.recording else e._greedy_runner

    def extra_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The step's inputs besides the slots and the tree."""
        return {}

    def prepare(self, tree: DraftTree | MaskTree, timer: PhaseTimer) -> DraftTree | MaskTree:
        return tree

    def verify(self, batch: Batch, tree: DraftTree | MaskTree | None, timer: PhaseTimer) -> _Verified:
        e = self.engine
        with timer("verify"):
            inputs = {"roots": batch.roots, "seq_lens": batch.seq_lens} if tree is None else tree.as_inputs()
            hidden, status, path, length, bonus, argmax, coins, table, *packed_data = self.runner(
                batch.size, slots=batch.slots, **self.extra_inputs(batch), **inputs)
        res = VerifyResult(status=status, accept_path=path, accept_length=length, bonus=bonus, coins=coins,
                           target_argmax=argmax)
        layout = (self.kind, 1 if tree is None else tree.tokens.shape[1])
        return _Verified(tree, hidden, res, table, lambda: PackedRows(e._record_layouts[layout], packed_data[0]))


class _SamplingVerify(_GreedyVerify):
    """Sampling: forward, lossless sampling verify and KV commit in one graphed step too
    (``Engine._sampling_step``, one runner per top-k and top-p), the temperature its per-row input."""

    greedy = False
    kind = "sampling"

    def __init__(self, engine: Engine, recording: bool, sampling: dict) -> None:
        super().__init__(engine, recording)
        self.sampling = sampling

    @property
    def runner(self) -> GraphRunner:
        return self.engine._sampling_runner(self.sampling["top_k"], self.sampling["top_p"], self.recording)

    def extra_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"temperature": self.engine._temperature_input(batch.size, self.sampling["temperature"])}


class _NotLearning:
    """A drafter that learns on the host (``host_accepted``: the N-gram trie), kept from learning
    ``Engine.warmup``'s dummy tokens: its admit, prefill and verify feeds are dropped, the rest delegated."""

    def __init__(self, drafter) -> None:
        self._drafter = drafter

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)

    def on_admit(self, request_ids: list[int], prompts: list[list[int]]) -> None:
        pass

    def on_prefill(self, prefill: Prefill) -> None:
        pass

    def on_verify(self, *args, **kwargs) -> None:
        pass


def _led_by(top_i: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """The top-k indices with the verifier's argmax first. Among tied logits torch's top-k may
    rank another token first, while the verifier takes the lowest id; the trace derives its
    target argmax from the top-1, so it must be the token the decision used."""
    am = argmax[..., None]
    swapped = torch.where(top_i == am, top_i[..., :1], top_i)
    return torch.cat([am, swapped[..., 1:]], dim=-1)


def _record_tensors(tree: DraftTree, res: VerifyResult, top_i: torch.Tensor, top_p: torch.Tensor, moved=None):
    """The per-request tensors of one iteration's trace row: its tree, the target's top-k,
    the verifier's decision (docs/INTERNALS.md, "trace/") and the cache rows the commit moved."""
    commit = [] if moved is None else [("commit_src", moved[0]), ("commit_dst", moved[1])]
    return [*commit,
        ("seq_len", tree.seq_lens), ("tokens", tree.tokens), ("parents", tree.parents), ("depth", tree.depth),
        ("scores", tree.scores), ("valid", tree.valid), ("mask", tree.mask), ("positions", tree.positions),
        ("retrieve_index", tree.retrieve_index), ("retrieve_next_token", tree.retrieve_next_token),
        ("retrieve_next_sibling", tree.retrieve_next_sibling),
        # target_argmax(_prob) is the top-1: the recorder derives it (two copies fewer in the graph).
        ("target_topk_tokens", top_i), ("target_topk_probs", top_p),
        ("status", res.status), ("accept_path", res.accept_path), ("accept_length", res.accept_length),
        ("bonus_token", res.bonus),
    ]


def _roots_alone(tree: MaskTree) -> MaskTree:
    """The one-node tree of the same roots (an N-gram iteration where no row matched)."""
    return MaskTree(tree.tokens[:, :1], tree.scores[:, :1], tree.mask[:, :1, :1], tree.valid[:, :1], tree.seq_lens,
                    max_depth=0)


def _roots_and_padding(tree: MaskTree, n: int) -> MaskTree:
    """The roots of a one-node tree with n - 1 padding nodes hanging off them, laid out as the
    trie lays out padding (token 0, score 0, not valid)."""
    b, dev = tree.tokens.shape[0], tree.tokens.device
    tokens = torch.zeros(b, n, dtype=tree.tokens.dtype, device=dev)
    scores = torch.zeros(b, n, dtype=tree.scores.dtype, device=dev)
    valid = torch.zeros(b, n, dtype=torch.bool, device=dev)
    tokens[:, 0], scores[:, 0], valid[:, 0] = tree.tokens[:, 0], tree.scores[:, 0], True
    mask = torch.eye(n, dtype=torch.bool, device=dev).repeat(b, 1, 1)
    mask[:, :, 0] = True
    return MaskTree(tokens, scores, mask, valid, tree.seq_lens, max_depth=n - 1)


def _host_table(tree: DraftTree, res: VerifyResult) -> torch.Tensor:
    """What the engine needs after a verify, as one int64 [B, 4 + W] table (made inside the greedy
    graph, so the host sync is a single copy). Per row: the next seq_len and root (INTERNALS.md:
    the commit adds accept length + 1, the bonus becomes the root; columns 0-1 advance the running
    batch on the device), the accept length, the tree's depth, then the tokens along the accepted
    path, root first (junk past the accept length)."""
    path_tokens = tree.tokens.gather(1, res.accept_path.clamp(min=0))
    length = res.accept_length[:, None]
    return torch.cat([tree.seq_lens[:, None] + length + 1, res.bonus[:, None], length,
                      tree.depth.amax(dim=1, keepdim=True), path_tokens], dim=1)


def _checked_ids(prompt, vocab: int) -> tuple[list[int], list[int]]:
    """``(ids, bad)``: the prompt's token ids as Python ints and those outside [0, vocab). An integer
    list, array or CPU tensor is converted and checked in one vectorised pass (a Python loop over a
    sixteen-prompt batch of 500 tokens each took half a millisecond of every call); anything else
    goes through ``int()`` one id at a time."""
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError, RuntimeError):  # ragged nesting, a CUDA tensor
        arr = None
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
        return arr.tolist(), arr[(arr < 0) | (arr >= vocab)].tolist()
    ids = [int(t) for t in prompt]
    return ids, [t for t in ids if not 0 <= t < vocab]


def graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Batch sizes captured as CUDA graphs: powers of two up to the first >= max_batch_size."""
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def _version() -> str:
    from spectool import __version__

    return __version__


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc="decoding")
