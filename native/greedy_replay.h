// Greedy what-if replay of a recorded workload through one NgramCorpus: the engine's batch
// schedule, the N-gram drafter's puts and gets, and the greedy verifier with the recorded
// output standing in for the target (spectool/tune/ngram_whatif.py describes the model).
#pragma once

#include <cstdint>
#include <vector>

#include "ngram_corpus.h"

namespace spectool {

// One recorded request: every target token known (prompt + output + verified tokens past
// it), the prompt length, and the length of prompt + output at which it finishes.
struct ReplayRequest {
  int64_t id;
  std::vector<int32_t> known;
  int64_t prompt_len;
  int64_t end;
};

// One entry per iteration and running request (rows), or per iteration; trees only when asked:
// row r's tree is tree_tokens / tree_parents / tree_valid [tree_offsets[r], tree_offsets[r + 1]).
struct ReplayRows {
  std::vector<int64_t> iteration, request_id, seq_len, accept_length;
  std::vector<uint8_t> censored;
  std::vector<int32_t> match_len;
  std::vector<int64_t> batch_size, num_nodes;
  std::vector<int32_t> tree_tokens, tree_parents;
  std::vector<uint8_t> tree_valid;
  std::vector<int64_t> tree_offsets{0};
};

// Replays `requests` (admission order) on an engine of `max_batch_size` slots; the corpus must
// be fresh (external corpora may be added).
void replay_greedy(NgramCorpus& corpus, const std::vector<ReplayRequest>& requests, int max_batch_size,
                   bool keep_trees, ReplayRows& out);

}  // namespace spectool
