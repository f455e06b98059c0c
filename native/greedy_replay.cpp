// The whole what-if loop of one N-gram configuration in C++: a sweep replays it once per
// configuration, and per iteration it is a few trie calls, which a Python loop around them
// would cost many times over. Every corpus call is the one NgramDrafter makes in the engine.
#include "greedy_replay.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <tuple>

namespace spectool {

namespace {

struct Slot {
  const ReplayRequest* req;
  int slot;
  int64_t seq_len;  // tokens in the cache: the root is known[seq_len]
};

// The greedy verifier against the known continuation: the deepest valid node whose root path
// is known[seq_len + 1 ..], ties to the lower index; censored when that path reached the end of
// what is known (the bonus, or a deeper match, is then unknown).
std::pair<int, bool> accept_against(const int32_t* tokens, const int32_t* parents, const bool* valid, int n,
                                    const std::vector<int32_t>& known, int64_t seq_len, std::vector<int>& depth,
                                    std::vector<uint8_t>& ok) {
  const int64_t limit = static_cast<int64_t>(known.size()) - seq_len;  // depths < limit are known
  if (limit <= 1) return {0, true};
  depth.assign(static_cast<size_t>(n), 0);
  ok.assign(static_cast<size_t>(n), 0);
  ok[0] = 1;
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (!valid[i]) continue;
    const int p = parents[i];
    const int d = depth[static_cast<size_t>(p)] + 1;
    depth[static_cast<size_t>(i)] = d;
    if (ok[static_cast<size_t>(p)] && d < limit && tokens[i] == known[static_cast<size_t>(seq_len + d)]) {
      ok[static_cast<size_t>(i)] = 1;
      best = std::max(best, d);
    }
  }
  return {best, best + 1 >= limit};
}

TokenBatch one_window(const std::vector<int32_t>& known, int64_t lo, int64_t hi) {
  TokenBatch b;
  b.tokens.assign(known.begin() + lo, known.begin() + hi);
  b.offsets.push_back(hi - lo);
  return b;
}

}  // namespace

void replay_greedy(NgramCorpus& corpus, const std::vector<ReplayRequest>& requests, int max_batch_size,
                   bool keep_trees, ReplayRows& out) {
  const int64_t depth = corpus.config().max_trie_depth;
  const int n = corpus.config().num_draft_tokens;
  const size_t cap = static_cast<size_t>(max_batch_size);
  std::vector<int32_t> tokens(cap * n), parents(cap * n), match_len(cap), breadth(cap);
  std::vector<float> scores(cap * n);
  std::unique_ptr<bool[]> mask(new bool[cap * n * n]), valid(new bool[cap * n]);
  std::vector<int> depth_scratch;
  std::vector<uint8_t> ok_scratch;

  std::deque<const ReplayRequest*> waiting;
  for (const ReplayRequest& r : requests) waiting.push_back(&r);
  std::vector<int> free_slots;
  for (int s = 0; s < max_batch_size; ++s) free_slots.push_back(s);
  std::vector<Slot> running;
  auto release = [&](const std::vector<int64_t>& ids) { corpus.erase_match_state(ids); };

  while (!waiting.empty() || !running.empty()) {
    // Admission: the lowest free slots, in order; the prompts, then each one's first token (two
    // puts, as the drafter makes them: the recency order they leave is what BFS drafts by).
    std::vector<Slot> admitted;
    while (!waiting.empty() && !free_slots.empty()) {
      admitted.push_back(Slot{waiting.front(), free_slots.front(), waiting.front()->prompt_len});
      waiting.pop_front();
      free_slots.erase(free_slots.begin());
    }
    if (!admitted.empty()) {
      TokenBatch prompts, firsts;
      std::vector<int64_t> ids, prompt_lens, first_lens;
      for (const Slot& a : admitted) {
        const std::vector<int32_t>& k = a.req->known;
        const int64_t p = a.req->prompt_len;
        prompts.tokens.insert(prompts.tokens.end(), k.begin(), k.begin() + p);
        prompts.offsets.push_back(static_cast<int64_t>(prompts.tokens.size()));
        firsts.tokens.insert(firsts.tokens.end(), k.begin() + std::max<int64_t>(0, p + 1 - depth), k.begin() + p + 1);
        firsts.offsets.push_back(static_cast<int64_t>(firsts.tokens.size()));
        ids.push_back(a.req->id);
        prompt_lens.push_back(p);
        first_lens.push_back(p + 1);
      }
      corpus.put(std::move(prompts), ids, std::move(prompt_lens));
      corpus.put(std::move(firsts), ids, std::move(first_lens));
      corpus.synchronize();
      for (const Slot& a : admitted) {
        if (a.req->end - a.req->prompt_len <= 1) {  // its one output token came from the prefill
          release({a.req->id});
          free_slots.push_back(a.slot);
          std::sort(free_slots.begin(), free_slots.end());
        } else {
          running.push_back(a);
        }
      }
      std::sort(running.begin(), running.end(), [](const Slot& x, const Slot& y) { return x.slot < y.slot; });
    }
    if (running.empty()) continue;

    // Draft: every running request's tree from its last max_trie_depth tokens, in slot order.
    const size_t bs = running.size();
    TokenBatch tails;
    std::vector<int64_t> ids, lens;
    for (const Slot& r : running) {
      const int64_t end = r.seq_len + 1;
      const std::vector<int32_t>& k = r.req->known;
      tails.tokens.insert(tails.tokens.end(), k.begin() + std::max<int64_t>(0, end - depth), k.begin() + end);
      tails.offsets.push_back(static_cast<int64_t>(tails.tokens.size()));
      ids.push_back(r.req->id);
      lens.push_back(end);
    }
    corpus.synchronize();
    DraftBuffers buf{tokens.data(), parents.data(), mask.get(), valid.get(), scores.data(), match_len.data(),
                     breadth.data()};
    corpus.get(tails, ids, lens, buf);
    bool any = false;  // no row matched: the engine verifies the roots alone (N = 1)
    for (size_t b = 0; b < bs && !any; ++b)
      for (int i = 1; i < n && !any; ++i) any = valid[b * n + i];
    const int iter_n = any ? n : 1;
    const int64_t it = static_cast<int64_t>(out.batch_size.size());
    out.batch_size.push_back(static_cast<int64_t>(bs));
    out.num_nodes.push_back(iter_n);

    // Verify against the recorded output, log, and put what each request gained.
    std::vector<int64_t> done;
    for (size_t b = 0; b < bs; ++b) {
      Slot& r = running[b];
      const std::vector<int32_t>& k = r.req->known;
      const int64_t size = static_cast<int64_t>(k.size());
      int a = 0;
      bool cut;
      if (any) {
        std::tie(a, cut) = accept_against(&tokens[b * n], &parents[b * n], &valid[b * n], n, k, r.seq_len,
                                          depth_scratch, ok_scratch);
      } else {
        cut = r.seq_len + 1 >= size;
      }
      out.iteration.push_back(it);
      out.request_id.push_back(r.req->id);
      out.seq_len.push_back(r.seq_len);
      out.accept_length.push_back(a);
      out.censored.push_back(cut);
      out.match_len.push_back(match_len[b]);
      if (keep_trees) {
        if (any) {
          out.tree_tokens.insert(out.tree_tokens.end(), &tokens[b * n], &tokens[b * n] + n);
          out.tree_parents.insert(out.tree_parents.end(), &parents[b * n], &parents[b * n] + n);
          out.tree_valid.insert(out.tree_valid.end(), &valid[b * n], &valid[b * n] + n);
        } else {
          out.tree_tokens.push_back(k[static_cast<size_t>(r.seq_len)]);
          out.tree_parents.push_back(-1);
          out.tree_valid.push_back(1);
        }
        out.tree_offsets.push_back(static_cast<int64_t>(out.tree_tokens.size()));
      }
      const int64_t end0 = r.seq_len + 1;
      const int64_t end = std::min(end0 + a + 1, size);
      // One put per window, in slot order: what the worker does with the drafter's batch.
      corpus.put(one_window(k, std::max<int64_t>(0, end0 - depth), end), {r.req->id}, {end});
      r.seq_len += a + 1;
      if (r.seq_len + 1 >= r.req->end) done.push_back(r.req->id);
    }
    if (!done.empty()) {
      release(done);
      std::vector<Slot> still;
      for (const Slot& r : running) {
        if (r.seq_len + 1 >= r.req->end)
          free_slots.push_back(r.slot);
        else
          still.push_back(r);
      }
      std::sort(free_slots.begin(), free_slots.end());
      running.swap(still);
    }
  }
}

}  // namespace spectool
