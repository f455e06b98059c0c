"""The on-disk trace schema: one Arrow row per (iteration, request).

The engine hands the recorder batch tensors named after STEP_FIELDS (leading
dimension = batch); the recorder turns each batch row into one Arrow row. Per-node
arrays have length N (the request's num_draft_tokens); the mask is bit-packed row
by row (numpy.packbits over the flattened N*N bools, big-endian bit order).

STEP_SCHEMA is the schema a reader hands out (``trace.steps``, ``iter_batches``,
SQL). On disk a column may be stored narrower (DISK_TYPES): the integer fields
bounded by the tree size in int16 / int8, and the target's and the drafter's
probabilities, which are shown and binned but never re-verified, in float16
(relative error <= 2**-11). The reader widens them back.
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: uncompressed, STEP_SCHEMA types on disk
MAGIC = "spectool-trace"

# Node status codes (DraftTree / verify).
NOT_VISITED, ACCEPTED, REJECTED = 0, 1, 2

_i32 = pa.list_(pa.int32())
_f32 = pa.list_(pa.float32())

# name -> (arrow type, meaning). Order is the column order on disk.
STEP_FIELDS: dict[str, tuple[pa.DataType, str]] = {
    "iteration": (pa.int32(), "iteration index within the run (0-based)"),
    "request_id": (pa.int32(), "request index in the order prompts were given"),
    "method": (pa.string(), "ngram | eagle | multi_layer_eagle | none"),
    "seq_len": (pa.int32(), "tokens in the cache before this iteration"),
    "num_nodes": (pa.int32(), "N: draft tree nodes including the root"),
    "tokens": (_i32, "draft tree tokens [N], node 0 = root"),
    "parents": (_i32, "parent index per node, -1 for the root"),
    "depth": (_i32, "depth per node, root 0"),
    "scores": (_f32, "draft score per node (EAGLE path prob; multi-layer per-layer top-1 prob; "
               "ngram frequency share or BFS rank)"),
    "valid": (pa.list_(pa.bool_()), "False for padding nodes"),
    "mask_packed": (pa.binary(), "tree mask as the verifier used it, packbits of N*N bools"),
    "positions": (pa.list_(pa.int64()), "RoPE positions per node"),
    "retrieve_index": (_i32, "b*N + i"),
    "retrieve_next_token": (_i32, "first child or -1"),
    "retrieve_next_sibling": (_i32, "next sibling or -1"),
    "ngram_match_len": (pa.int32(), "matched suffix length (ngram), -1 otherwise"),
    "ngram_breadth": (pa.int32(), "BFS breadth used (ngram), -1 otherwise"),
    "step_topk_tokens": (_i32, "EAGLE per-step top-k tokens, flattened [S*K] (see step_topk_shape)"),
    "step_topk_probs": (_f32, "EAGLE per-step top-k probabilities, flattened [S*K]"),
    "step_topk_shape": (_i32, "[S, K] of the two fields above, [] when absent"),
    "target_argmax": (_i32, "target argmax token at every node"),
    "target_argmax_prob": (_f32, "its probability"),
    "target_topk_tokens": (_i32, "target top-k tokens per node, flattened [N*k]"),
    "target_topk_probs": (_f32, "their probabilities, flattened [N*k]"),
    "status": (pa.list_(pa.int8()), "0 not visited, 1 accepted, 2 rejected"),
    "accept_path": (_i32, "accepted node indices, root first"),
    "accept_length": (pa.int32(), "accepted draft tokens (len(accept_path) - 1)"),
    "bonus_token": (pa.int32(), "token the target adds after the accepted path"),
    "coins": (_f32, "sampling: uniform coin per node (NaN = unused); empty when greedy"),
    "temperature": (pa.float32(), "0 for greedy"),
    "child_probs": (_f32, "sampling: p(token | parent) of every node after temperature / top-k / top-p "
                    "(NaN at the root); null when greedy"),
    "bonus_cdf": (_f32, "sampling: [residual mass before the bonus token, the bonus token's residual "
                  "probability] (the bonus is the residual's inverse CDF at coin - children's mass)"),
    "commit_src": (_i32, "cache rows the KV commit copied from, root first (seq_len + accepted node)"),
    "commit_dst": (_i32, "the cache rows it copied them to (seq_len + j)"),
    "ngram_put_len": (pa.int32(), "ngram: tokens of the request the corpus had been given when it "
                      "drafted, -1 otherwise"),
    "draft_us": (pa.float32(), "time drafting (µs)"),
    "index_us": (pa.float32(), "time building tree indices (µs)"),
    "verify_us": (pa.float32(), "time in the verify forward (µs)"),
    "commit_us": (pa.float32(), "time accepting and committing KV (µs)"),
    "trie_get_us": (pa.float32(), "ngram: corpus batch_get (µs)"),
    "trie_put_us": (pa.float32(), "ngram: corpus batch_put (µs)"),
    "iteration_us": (pa.float32(), "wall time of the whole iteration (µs), the same for every row of "
                     "the iteration; tokens/s = gained tokens / its sum over iterations"),
}

# Columns a trace may lack (written before they existed): they read back as nulls.
OPTIONAL_STEP_FIELDS = frozenset({"child_probs", "bonus_cdf", "commit_src", "commit_dst", "ngram_put_len"})

# Phase timings, in the order an iteration runs them (summary, Perfetto export).
PHASE_FIELDS = ("draft_us", "index_us", "verify_us", "commit_us", "trie_get_us", "trie_put_us")

STEP_SCHEMA = pa.schema([pa.field(name, typ) for name, (typ, _) in STEP_FIELDS.items()])

_i16 = pa.list_(pa.int16())
# Narrower on-disk types (format version 2); a field not named here is stored as in STEP_SCHEMA.
# Node indices and depths fit int16 for any tree below 32768 nodes; writing a value that does not
# fit raises instead of wrapping.
DISK_TYPES: dict[str, pa.DataType] = {
    "num_nodes": pa.int16(),
    "parents": _i16,
    "depth": _i16,
    "positions": pa.list_(pa.int32()),
    "retrieve_next_token": _i16,
    "retrieve_next_sibling": _i16,
    "ngram_match_len": pa.int16(),
    "ngram_breadth": pa.int16(),
    "step_topk_probs": pa.list_(pa.float16()),
    "step_topk_shape": _i16,
    "target_argmax_prob": pa.list_(pa.float16()),
    "target_topk_probs": pa.list_(pa.float16()),
    "accept_path": _i16,
    "accept_length": pa.int16(),
}

REQUEST_FIELDS: dict[str, tuple[pa.DataType, str]] = {
    "request_id": (pa.int32(), "request index"),
    "prompt_tokens": (_i32, "prompt token ids"),
    "output_tokens": (_i32, "generated token ids"),
    "finish_reason": (pa.string(), "stop | length | prefill | aborted"),
    "prompt_text": (pa.string(), "prompt as given (empty when given as ids)"),
}

REQUEST_SCHEMA = pa.schema([pa.field(name, typ) for name, (typ, _) in REQUEST_FIELDS.items()])


def with_optional_columns(table: pa.Table) -> pa.Table:
    """``table`` with a null column for each optional step field it lacks (an older trace)."""
    for name in sorted(OPTIONAL_STEP_FIELDS - set(table.column_names)):
        typ = STEP_FIELDS[name][0]
        table = table.append_column(pa.field(name, typ), pa.nulls(table.num_rows, typ))
    return table
