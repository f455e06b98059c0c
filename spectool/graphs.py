"""CUDA-graph capture and replay of a step function, per batch-size bucket.

At batch 1 a decode step launches hundreds of small kernels; replaying them from a
captured CUDA graph removes the CPU launch cost, which otherwise exceeds the GPU time.

    runner = GraphRunner(step, buckets=(1, 2, 4, 8, 16, 32, 64), enabled=True,
                         pad_values={"slots": scratch_slot})
    out = runner(batch_size, tokens=tokens, positions=positions, slots=slots, starts=starts)
    runner.stats   # {"replays": .., "eager": .., "captures": ..}

``step(**tensors)`` is any function of tensors whose leading dim is the batch (the
target decode step: tokens, positions, slots, starts -> logits; a verify step with
tree_mask; a draft layer step). It returns a tensor or a tuple/dict of tensors whose
leading dim is the batch.

How a call runs:

* The batch is rounded up to the smallest bucket that holds it (and, per input, the
  shape beyond the batch dim must match what the graph was captured with, e.g. the
  same T). Inputs are copied into static buffers owned by the runner; rows past
  ``batch_size`` are filled with ``pad_values[name]`` (default 0). The engine points
  them at harmless data, e.g. ``slots=<scratch slot>`` so padded rows write only to a
  cache slot nobody reads.
* The first call for a (bucket, input shapes) key warms the function up on a side
  stream (lazy inits, Triton autotuning, cuBLAS workspaces), then captures it into a
  graph that shares one memory pool with every other graph of this runner.
* Later calls copy inputs and replay. Outputs are the graph's static tensors sliced to
  ``batch_size``: they are overwritten by the next replay, so clone what must survive.
* Batches larger than every bucket, CPU tensors, or ``enabled=False`` run eagerly and
  count in ``stats["eager"]``.

The function runs eagerly ``warmup_iters`` times before a capture, on the real inputs,
so its side effects must be idempotent (writing K/V at ``starts`` is; ``starts += 1``
inside it is not). It must be graph safe: no host syncs (``.item()``, data-dependent shapes),
no allocation of tensors that outlive the call other than its outputs. Anything it
reads besides its tensor arguments (weights, the KV cache) must keep its address.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

Outputs = Any  # a tensor, or a tuple / list / dict of tensors


def _map(fn: Callable[[torch.Tensor], torch.Tensor], out: Outputs) -> Outputs:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, dict):
        return {k: _map(fn, v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_map(fn, v) for v in out)
    raise TypeError(f"graph outputs must be tensors (or tuples/dicts of them), got {type(out).__name__}")


@contextlib.contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Hold Python's cycle collector off during a capture: a collection there can free an earlier
    engine's CUDA graphs, and destroying a graph while a stream captures invalidates the capture
    (torch no longer collects before capturing). The garbage waits for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Graph:
    """One captured graph with its static input buffers and output tensors.

    ``filled[name]`` = (tensor, its version, batch size) of the last copy into that buffer:
    a later call passing the very same, unmodified tensor at the same batch size skips the
    copy (the engine passes cached constant tree arrays every iteration). Holding the
    tensor keeps its identity from being reused by a new one. Inference-mode tensors keep
    no version counter, so they are always copied.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor], outputs: Outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.filled: dict[str, tuple[torch.Tensor, int, int]] = {}


class GraphRunner:
    """Capture ``fn`` once per (batch bucket, input shapes) and replay it (see the module docstring).

    Args:
        fn: ``fn(**tensors) -> tensor | tuple | dict of tensors``, leading dim = batch.
        buckets: batch sizes to capture; a call uses the smallest one >= its batch size.
        enabled: False runs everything eagerly (for comparison and debugging).
        pad_values: fill value per input name for the padding rows of a bucket.
        warmup_iters: eager runs on the side stream before a capture.
    """

    def __init__(self, fn: Callable[..., Outputs], buckets: Iterable[int] = (1, 2, 4, 8, 16, 32, 64),
                 enabled: bool = True, pad_values: dict[str, int | float] | None = None,
                 warmup_iters: int = 2):
        self.fn = fn
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.enabled = enabled
        self.pad_values = dict(pad_values or {})
        self.warmup_iters = warmup_iters
        self.stats = {"replays": 0, "eager": 0, "captures": 0}
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None  # one memory pool shared by all graphs of this runner

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket holding ``batch_size``, or None (eager)."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def __call__(self, batch_size: int, **tensors: torch.Tensor) -> Outputs:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch_size:
                raise ValueError(f"input {name!r} must be a tensor with leading dim {batch_size}")
        bucket = self.bucket_for(batch_size)
        on_cuda = all(t.is_cuda for t in tensors.values()) and bool(tensors)
        if not self.enabled or bucket is None or not on_cuda:
            self.stats["eager"] += 1
            return self.fn(**tensors)
        key = self._key(bucket, tensors)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(bucket, tensors)
            self._graphs[key] = graph
        self._fill(graph.inputs, batch_size, tensors, graph.filled)
        graph.graph.replay()
        self.stats["replays"] += 1
        return _map(lambda t: t[:batch_size], graph.outputs)

    def capture(self, batch_size: int, **tensors: torch.Tensor) -> None:
        """Warm up and capture ahead of time (e.g. at engine start), with example inputs."""
        bucket = self.bucket_for(batch_size)
        if self.enabled and bucket is not None:
            key = self._key(bucket, tensors)
            if key not in self._graphs:
                self._graphs[key] = self._capture(bucket, tensors)

    def reset(self) -> None:
        """Drop every captured graph (e.g. after the function's weights or caches were replaced)."""
        self._graphs.clear()
        self._pool = None

    @staticmethod
    def _key(bucket: int, tensors: dict[str, torch.Tensor]) -> tuple:
        return (bucket, *((n, tuple(t.shape[1:]), t.dtype, t.device) for n, t in sorted(tensors.items())))

    def _fill(self, static: dict[str, torch.Tensor], batch_size: int,
              tensors: dict[str, torch.Tensor], filled: dict | None = None) -> None:
        dsts, srcs = [], []
        for name, t in tensors.items():
            if filled is not None and not t.is_inference():
                last = filled.get(name)
                if last is not None and last[0] is t and last[1] == t._version and last[2] == batch_size:
                    continue
                filled[name] = (t, t._version, batch_size)
            buf = static[name]
            if batch_size < buf.shape[0]:
                buf[batch_size:].fill_(self.pad_values.get(name, 0))
                buf = buf[:batch_size]
            dsts.append(buf)
            srcs.append(t)
        if dsts:
            # One call (and on CUDA a few fused launches) instead of a copy launch per input: a
            # verify step takes a dozen tree tensors, and each launch costs the host microseconds.
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def _capture(self, bucket: int, tensors: dict[str, torch.Tensor]) -> _Graph:
        static = {name: torch.empty((bucket, *t.shape[1:]), dtype=t.dtype, device=t.device)
                  for name, t in tensors.items()}
        self._fill(static, next(iter(tensors.values())).shape[0], tensors)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                self.fn(**static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Thread-local: the trace writer thread waits on CUDA events while the engine's thread
        # captures; in the default (global) mode that wait invalidates the capture.
        with _no_garbage_collection(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self.fn(**static)
        self.stats["captures"] += 1
        return _Graph(graph, static, outputs)
