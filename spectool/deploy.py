"""Deployment settings in, as they are: SGLang's ``--speculative-*`` flags and vLLM's
``speculative_config`` turned into the spectool draft config that builds the same trees.

docs/DEPLOYMENT.md tabulates every setting. SGLang flags spectool cannot honour are refused by
name (a silently ignored flag would make the trees inspected here differ from the server's);
vLLM settings without a counterpart are stated in a ``DeploymentWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from spectool.config import DraftConfig, DraftModelConfig, Eagle3Config, EagleConfig, NgramConfig


class DeploymentWarning(UserWarning):
    """A deployment setting that spectool maps only approximately, or not at all."""


# SGLang flag -> (destination, how its value is read)
SGLANG_FLAGS = {
    "--speculative-algorithm": ("algorithm", str),
    "--speculative-draft-model-path": ("path", str),
    "--speculative-num-steps": ("num_steps", int),
    "--speculative-eagle-topk": ("topk", int),
    "--speculative-num-draft-tokens": ("num_draft_tokens", int),
    "--speculative-ngram-min-bfs-breadth": ("min_bfs_breadth", int),
    "--speculative-ngram-max-bfs-breadth": ("max_bfs_breadth", int),
    "--speculative-ngram-max-trie-depth": ("max_trie_depth", int),
    "--speculative-ngram-match-type": ("match", str),
    "--speculative-ngram-capacity": ("capacity", int),
}
# What SGLang picks for a Llama-family target when steps, top-k and draft tokens are not given.
SGLANG_AUTO_TREE = {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}
_SGLANG_TREE = {"EAGLE": EagleConfig, "EAGLE3": Eagle3Config, "STANDALONE": DraftModelConfig}
_SGLANG_WHY_NOT = {
    "--speculative-token-map": "it restricts EAGLE's vocabulary to a hot-token file (FR-Spec), which spectool "
                               "does not implement",
    "--speculative-accept-threshold-single": "relaxed acceptance is not lossless; spectool verifies exactly",
    "--speculative-accept-threshold-acc": "relaxed acceptance is not lossless; spectool verifies exactly",
    "--speculative-draft-model-revision": "spectool loads a local directory or the hub's default revision",
    "--speculative-draft-model-quantization": "spectool runs the draft in the target's dtype",
}


def parse_sglang_flags(args: Sequence[str]) -> dict:
    """``{destination: value}`` of SGLang speculative flags (``--flag value`` or ``--flag=value``).

    Raises:
        ValueError: a flag spectool cannot honour, named (with why, where known), or a bad value.
    """
    out: dict = {}
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        flag, eq, value = arg.partition("=")
        if flag not in SGLANG_FLAGS:
            if flag in _SGLANG_WHY_NOT:
                raise ValueError(f"SGLang flag {flag} cannot be honoured: {_SGLANG_WHY_NOT[flag]}")
            if flag.startswith("--speculative-"):
                raise ValueError(f"SGLang flag {flag} has no spectool counterpart; supported: "
                                 f"{', '.join(SGLANG_FLAGS)}")
            raise ValueError(f"{arg!r} is not an SGLang speculative-decoding flag (--speculative-*)")
        if not eq:
            i += 1
            if i >= len(items):
                raise ValueError(f"SGLang flag {flag} needs a value")
            value = items[i]
        dest, kind = SGLANG_FLAGS[flag]
        try:
            out[dest] = kind(value)
        except ValueError:
            raise ValueError(f"SGLang flag {flag} needs an integer, got {value!r}") from None
        i += 1
    return out


def draft_from_sglang_args(args: Sequence[str]) -> DraftConfig | None:
    """The spectool draft config for SGLang's ``--speculative-*`` flags (None: no algorithm given).

    ``--speculative-algorithm`` NGRAM -> NgramConfig, EAGLE -> EagleConfig, EAGLE3 -> Eagle3Config,
    STANDALONE -> DraftModelConfig. Where steps, top-k and draft tokens are left out, SGLang's own
    choice for Llama targets (5, 4, 8) is used, with a DeploymentWarning saying so.

    Raises:
        ValueError: a flag spectool cannot honour (named), a missing draft path, bad values.
    """
    given = parse_sglang_flags(args)
    algorithm = given.pop("algorithm", None)
    if algorithm is None:
        if given:
            raise ValueError(f"SGLang flags {', '.join(sorted(given))} given without --speculative-algorithm")
        return None
    algorithm = algorithm.upper()
    ngram = {"min_bfs_breadth", "max_bfs_breadth", "max_trie_depth", "match", "capacity"}
    if algorithm in ("NGRAM", "LOOKAHEAD"):
        for name in ("path", "num_steps", "topk"):
            if name in given:
                raise ValueError(f"SGLang flag {_flag(name)} does not apply to --speculative-algorithm NGRAM")
        if "match" in given:
            match = given["match"].upper()
            if match not in ("BFS", "PROB"):
                raise ValueError(f"--speculative-ngram-match-type must be BFS or PROB, got {given['match']!r}")
            given["match"] = match.lower()
        return NgramConfig(**given)
    if algorithm not in _SGLANG_TREE:
        raise ValueError(f"--speculative-algorithm {algorithm} cannot be honoured: spectool drafts with NGRAM, "
                         "EAGLE, EAGLE3 and STANDALONE" + (" (NEXTN reads MTP weights inside the target "
                                                            "checkpoint, which spectool does not load)"
                                                            if algorithm == "NEXTN" else ""))
    stray = sorted(ngram & set(given))
    if stray:
        raise ValueError(f"SGLang flag {_flag(stray[0])} applies only to --speculative-algorithm NGRAM")
    if "path" not in given:
        raise ValueError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    missing = {k: v for k, v in SGLANG_AUTO_TREE.items() if k not in given}
    if missing:
        warnings.warn(f"SGLang chooses {', '.join(_flag(k) for k in missing)} itself when not given; spectool "
                      f"uses its choice for Llama targets: {missing}", DeploymentWarning, stacklevel=2)
    settings = {**SGLANG_AUTO_TREE, **given}
    if settings["topk"] == 1 and settings["num_draft_tokens"] != settings["num_steps"] + 1:
        # SGLang's own rule for chains: every step's token is verified.
        warnings.warn(f"with --speculative-eagle-topk 1 SGLang sets --speculative-num-draft-tokens to num_steps + 1 "
                      f"= {settings['num_steps'] + 1}; so does spectool", DeploymentWarning, stacklevel=2)
        settings["num_draft_tokens"] = settings["num_steps"] + 1
    return _SGLANG_TREE[algorithm](**settings)


def _flag(dest: str) -> str:
    return next(flag for flag, (d, _) in SGLANG_FLAGS.items() if d == dest)


_VLLM_NO_EFFECT = {
    "draft_tensor_parallel_size": "spectool runs the draft on the target's device",
    "disable_by_batch_size": "spectool always speculates",
    "max_model_len": "spectool's limit is the engine's max_seq_len",
    "revision": "spectool loads a local directory or the hub's default revision",
    "code_revision": "spectool loads a local directory or the hub's default revision",
    "quantization": "spectool runs the draft in the target's dtype",
    "disable_padded_drafter_batch": "spectool's batching does not change the trees",
    "parallel_drafting": "spectool drafts step by step",
}


def draft_from_vllm_config(config: Mapping) -> DraftConfig | None:
    """The spectool draft config for vLLM's ``speculative_config`` dict (None when it is empty).

    ``method`` ngram -> NgramConfig (a chain: breadth 1), eagle -> EagleConfig, eagle3 ->
    Eagle3Config, draft_model -> DraftModelConfig; vLLM drafts chains (top-k 1) of
    ``num_speculative_tokens``. What has no exact counterpart is stated in a DeploymentWarning.

    Raises:
        ValueError: an unknown or unsupported method, a missing model or token count.
    """
    cfg = dict(config)
    if not cfg:
        return None
    method = cfg.pop("method", None)
    model = cfg.pop("model", None)
    if method is None:  # vLLM infers the method from the model's name
        name = str(model or "").lower()
        method = "ngram" if model in (None, "[ngram]") else "eagle3" if "eagle3" in name else \
            "eagle" if "eagle" in name else "draft_model"
        _warn(f"speculative_config has no 'method'; vLLM infers it from the model name, as spectool does: {method!r}")
    k = cfg.pop("num_speculative_tokens", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_config needs num_speculative_tokens, a positive int; got {k!r}")
    lookup_min, lookup_max = cfg.pop("prompt_lookup_min", None), cfg.pop("prompt_lookup_max", None)
    tree = cfg.pop("speculative_token_tree", None)
    for key, why in _VLLM_NO_EFFECT.items():
        if key in cfg:
            _warn(f"speculative_config {key}={cfg.pop(key)!r} is not mapped: {why}")
    for key in list(cfg):
        _warn(f"speculative_config {key}={cfg.pop(key)!r} has no spectool counterpart and is not mapped")
    if method == "ngram":
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = 5
        lookup_min = lookup_max if lookup_min is None else lookup_min
        lookup_max = lookup_min if lookup_max is None else lookup_max
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"prompt_lookup_min ({lookup_min}) must be in [1, prompt_lookup_max ({lookup_max})]")
        _warn("vLLM's n-gram proposer matches the request's own tokens (the longest suffix of "
              f"{lookup_min}..{lookup_max} tokens) and drafts the chain that followed it; spectool's trie holds "
              "every request's tokens, so it is mapped to breadth 1 (a chain of num_speculative_tokens) over a "
              f"trie of depth prompt_lookup_max + num_speculative_tokens = {lookup_max + k}, with recency "
              f"matching (bfs); matches shorter than prompt_lookup_min={lookup_min} are not excluded")
        return NgramConfig(max_bfs_breadth=1, min_bfs_breadth=1, max_trie_depth=lookup_max + k,
                           num_draft_tokens=k + 1, match="bfs")
    for key, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
        if value is not None:
            _warn(f"speculative_config {key}={value!r} applies only to method 'ngram' and is not mapped")
    kinds = {"eagle": EagleConfig, "eagle3": Eagle3Config, "draft_model": DraftModelConfig}
    if method not in kinds:
        raise ValueError(f"speculative_config method {method!r} is not supported: spectool maps ngram, eagle, "
                         "eagle3 and draft_model")
    if not model:
        raise ValueError(f"speculative_config method {method!r} needs 'model' (the draft's path or hub id)")
    if tree is not None:
        _warn("speculative_token_tree (a static tree) is not mapped: spectool drafts a chain as vLLM does by "
              "default; an EAGLE-2 dynamic tree is spectool's topk > 1")
    return kinds[method](model, num_steps=k, topk=1, num_draft_tokens=k + 1)


def _warn(message: str) -> None:
    warnings.warn(message, DeploymentWarning, stacklevel=3)
