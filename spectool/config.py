"""Draft-method configurations: what a user passes as ``Engine(target, draft=...)``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class NgramConfig:
    """Model-free N-gram drafting from a trie over everything seen so far.

    Args:
        max_bfs_breadth: children kept per node for the shortest suffix match (``bfs``).
        min_bfs_breadth: children kept per node for the longest suffix match (``bfs``).
        max_trie_depth: longest n-gram stored and matched.
        num_draft_tokens: N, tree nodes per request including the root.
        match: ``"bfs"`` (recency) or ``"prob"`` (frequency, best-first).
        capacity: trie nodes before LRU eviction of leaves.
        external_corpus: optional text or JSONL file whose token stream is also drafted from.
        external_corpus_max_tokens: token budget for the external corpus.
    """

    max_bfs_breadth: int = 10
    min_bfs_breadth: int = 1
    max_trie_depth: int = 18
    num_draft_tokens: int = 12
    match: str = "bfs"
    capacity: int = 10_000_000
    external_corpus: str | Path | None = None
    external_corpus_max_tokens: int = 1_000_000

    method = "ngram"

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (root + at least one draft), got {self.num_draft_tokens}")
        if self.min_bfs_breadth < 1:
            raise ValueError(f"min_bfs_breadth must be >= 1, got {self.min_bfs_breadth}")
        if self.min_bfs_breadth > self.max_bfs_breadth:
            raise ValueError(
                f"min_bfs_breadth ({self.min_bfs_breadth}) > max_bfs_breadth ({self.max_bfs_breadth})")
        if self.max_trie_depth < 1:
            raise ValueError(f"max_trie_depth must be >= 1, got {self.max_trie_depth}")
        if self.match not in ("bfs", "prob"):
            raise ValueError(f"match must be 'bfs' or 'prob', got {self.match!r}")
        if self.external_corpus is not None and not Path(self.external_corpus).is_file():
            raise ValueError(f"external_corpus {self.external_corpus!s} is not a readable file")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["method"] = self.method
        d["external_corpus"] = None if self.external_corpus is None else str(self.external_corpus)
        return d


class _CheckpointDraft:
    """What the configs of a draft loaded from a checkpoint share: their dict form (traces record it)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["method"] = self.method
        d["path"] = str(self.path)
        return d


class _TreeDraft(_CheckpointDraft):
    """A checkpoint draft whose steps, top-k and N shape an EAGLE-2 tree (checked when made)."""

    def __post_init__(self) -> None:
        _check_tree(self.num_steps, self.topk, self.num_draft_tokens)


@dataclass(frozen=True)
class EagleConfig(_TreeDraft):
    """EAGLE-2 drafting: one draft layer reused for ``num_steps`` steps, top-k tree.

    Args:
        path: directory of the draft checkpoint (config.json + safetensors).
        num_steps: draft steps (tree depth).
        topk: children expanded per frontier node per step.
        num_draft_tokens: N, tree nodes including the root (the best N-1 by path score).
    """

    path: str | Path
    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 16

    method = "eagle"


def _check_tree(num_steps: int, topk: int, num_draft_tokens: int) -> None:
    """The settings of an EAGLE-2 tree: steps, top-k and N must describe a tree that exists."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if num_draft_tokens < 2:
        raise ValueError(f"num_draft_tokens must be >= 2 (root + at least one draft), got {num_draft_tokens}")
    most = 1 + topk + (num_steps - 1) * topk * topk
    if num_draft_tokens > most:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} is more than the tree of {num_steps} steps "
            f"with topk={topk} can hold ({most})")


@dataclass(frozen=True)
class Eagle3Config(_TreeDraft):
    """EAGLE-3 drafting (a SpecForge / SGLang / vLLM ``LlamaForCausalLMEagle3`` checkpoint):
    the draft reads three target layers through ``fc`` and drafts an EAGLE-2 tree over its own
    reduced vocabulary, mapped to target ids by ``d2t``.

    Args:
        path: directory of the EAGLE-3 checkpoint (config.json + model.safetensors or pytorch_model.bin).
        num_steps: draft steps (tree depth).
        topk: children expanded per frontier node per step.
        num_draft_tokens: N, tree nodes including the root (the best N-1 by path score).
    """

    path: str | Path
    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 16

    method = "eagle3"


@dataclass(frozen=True)
class DraftModelConfig(_TreeDraft):
    """A small Llama-family model with the target's tokenizer as the draft: it drafts a chain
    (topk=1) or an EAGLE-2 tree from its own KV cache.

    Args:
        path: the draft model's directory (Hugging Face format, as ``spectool.load`` takes) or hub id.
        num_steps: draft steps (tree depth).
        topk: children expanded per frontier node per step (1: a chain of num_steps tokens).
        num_draft_tokens: N, tree nodes including the root.
    """

    path: str | Path
    num_steps: int = 4
    topk: int = 1
    num_draft_tokens: int = 5

    method = "draft_model"


@dataclass(frozen=True)
class MultiLayerEagleConfig(_CheckpointDraft):
    """Multi-layer EAGLE: K independent draft layers, layer k drafts k+1 tokens ahead.

    Args:
        path: directory of the draft checkpoint holding K layers.
        num_steps: how many of the layers to use (a chain of num_steps + 1 nodes); <= K.
    """

    path: str | Path
    num_steps: int = 4

    method = "multi_layer_eagle"

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")

    @property
    def num_draft_tokens(self) -> int:
        return self.num_steps + 1


DraftConfig = NgramConfig | EagleConfig | MultiLayerEagleConfig | Eagle3Config | DraftModelConfig
