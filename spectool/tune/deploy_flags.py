"""A draft config as serving-engine settings: SGLang launch flags and a vLLM speculative_config.

Only the settings both sides share are written; everything else keeps the server's default.
The draft checkpoint path is the one spectool used (convert or point it at the server's copy).
"""

from __future__ import annotations

import json

_SGLANG_ALGORITHM = {"ngram": "NGRAM", "eagle": "EAGLE", "multi_layer_eagle": "EAGLE"}


def sglang_flags(config) -> list[str]:
    """SGLang ``--speculative-*`` launch flags equivalent to ``config`` (a spectool draft config)."""
    algo = _SGLANG_ALGORITHM[config.method]
    flags = ["--speculative-algorithm", algo]
    if config.method == "ngram":
        flags += ["--speculative-num-draft-tokens", str(config.num_draft_tokens),
                  "--speculative-ngram-min-bfs-breadth", str(config.min_bfs_breadth),
                  "--speculative-ngram-max-bfs-breadth", str(config.max_bfs_breadth),
                  "--speculative-ngram-max-trie-depth", str(config.max_trie_depth),
                  "--speculative-ngram-match-type", config.match.upper()]
        return flags
    flags += ["--speculative-draft-model-path", str(config.path)]
    if config.method == "eagle":
        flags += ["--speculative-num-steps", str(config.num_steps), "--speculative-eagle-topk", str(config.topk),
                  "--speculative-num-draft-tokens", str(config.num_draft_tokens)]
    else:  # one draft layer per step: a top-1 chain of num_steps + 1 nodes
        flags += ["--speculative-num-steps", str(config.num_steps), "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", str(config.num_steps + 1)]
    return flags


def vllm_speculative_config(config) -> dict:
    """vLLM's ``speculative_config`` for ``config``."""
    if config.method == "ngram":
        # vLLM's n-gram proposer is a prompt-lookup chain: a lookup window and a chain length.
        return {"method": "ngram", "num_speculative_tokens": config.num_draft_tokens - 1,
                "prompt_lookup_max": config.max_trie_depth - 1, "prompt_lookup_min": 1}
    if config.method == "eagle":
        return {"method": "eagle", "model": str(config.path), "num_speculative_tokens": config.num_steps}
    return {"method": "mtp", "model": str(config.path), "num_speculative_tokens": config.num_steps}


def format_flags(flags: list[str]) -> str:
    """The flags as one shell line."""
    return " ".join(flags)


def format_vllm(config) -> str:
    return json.dumps(vllm_speculative_config(config))
