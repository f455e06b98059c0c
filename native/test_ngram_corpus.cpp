// Sanitizer driver for the n-gram corpus (built by tests/test_native_sanitizers.py,
// not part of the extension): puts on the caller's thread and the worker thread while
// another thread gets, with eviction, external corpora, erase and reset in between.
// Also checks that renumbering stamps (forced by a low stamp limit) changes nothing.
// Exits 0 and prints "ok" when every tree it saw was well formed.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "ngram_corpus.h"

using namespace spectool;

namespace {

struct Rng {
  uint64_t s;
  uint32_t next(uint32_t n) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(s >> 33) % n;
  }
};

void fail(const char* what) {
  std::fprintf(stderr, "FAILED: %s\n", what);
  std::exit(1);
}

void check_trees(const CorpusConfig& c, int64_t bs, const std::vector<int32_t>& parents, const std::vector<char>& mask,
                 const std::vector<char>& valid) {
  const int n = c.num_draft_tokens;
  for (int64_t b = 0; b < bs; ++b) {
    if (parents[b * n] != -1 || !valid[b * n]) fail("root");
    for (int i = 1; i < n; ++i) {
      int p = parents[b * n + i];
      if (p < 0 || p >= i) fail("topological order");
      if (!mask[(b * n + i) * n + i] || !mask[(b * n + i) * n + p]) fail("mask");
      if (valid[b * n + i] && !valid[b * n + i - 1]) fail("padding not last");
    }
  }
}

// vocab 12 and capacity 300 keep the trie small and evicting; `skewed` (half the tokens are 0,
// the rest of a vocabulary of 80, capacity 3000) gives node 0 dozens of children, the nodes whose
// children the trie keeps ranked for PROB while puts count, create and evict them.
void run(Match match, bool skewed = false) {
  CorpusConfig c;
  c.max_trie_depth = 8;
  c.num_draft_tokens = 12;
  c.max_bfs_breadth = 4;
  c.match = match;
  c.capacity = skewed ? 3000 : 300;
  auto token = [skewed](Rng& rng) {
    if (!skewed) return static_cast<int32_t>(rng.next(12));
    return rng.next(2) == 0 ? 0 : 1 + static_cast<int32_t>(rng.next(80));
  };
  NgramCorpus corpus(c);
  std::atomic<bool> done{false};

  std::thread getter([&] {
    Rng rng{7};
    const int64_t bs = 8;
    const int n = c.num_draft_tokens;
    std::vector<int32_t> tokens(bs * n), parents(bs * n), match_len(bs), breadth(bs);
    std::vector<char> mask(bs * n * n), valid(bs * n);
    std::vector<float> scores(bs * n);
    // bool buffers: std::vector<bool> has no data(), so use char storage of the same size
    static_assert(sizeof(bool) == sizeof(char), "bool buffers");
    DraftBuffers out{tokens.data(), parents.data(), reinterpret_cast<bool*>(mask.data()),
                     reinterpret_cast<bool*>(valid.data()), scores.data(), match_len.data(), breadth.data()};
    int64_t step = 0;
    while (!done.load()) {
      TokenBatch tails;
      std::vector<int64_t> ids, lens;
      for (int64_t b = 0; b < bs; ++b) {
        int len = 1 + static_cast<int>(rng.next(10));
        for (int j = 0; j < len; ++j) tails.tokens.push_back(token(rng));
        tails.offsets.push_back(static_cast<int64_t>(tails.tokens.size()));
        ids.push_back(b);
        lens.push_back(len + step);
      }
      ++step;
      corpus.get(tails, ids, lens, out);
      check_trees(c, bs, parents, mask, valid);
    }
  });

  Rng rng{1};
  std::vector<std::vector<int32_t>> streams(16);
  for (int it = 0; it < 3000; ++it) {
    TokenBatch windows;
    std::vector<int64_t> ids, lens;
    for (int r = 0; r < 4; ++r) {
      int64_t id = rng.next(16);
      auto& s = streams[id];
      int add = 1 + static_cast<int>(rng.next(3));
      for (int j = 0; j < add; ++j) s.push_back(token(rng));
      size_t w = std::min<size_t>(s.size(), 10);
      windows.tokens.insert(windows.tokens.end(), s.end() - static_cast<std::ptrdiff_t>(w), s.end());
      windows.offsets.push_back(static_cast<int64_t>(windows.tokens.size()));
      ids.push_back(id);
      lens.push_back(static_cast<int64_t>(s.size()));
    }
    if (it % 5 == 0)
      corpus.put(windows, {}, {});
    else
      corpus.put(windows, ids, lens);
    if (it % 400 == 0) {
      std::vector<std::vector<int32_t>> chunks(3);
      for (auto& ch : chunks)
        for (int j = 0; j < 200; ++j) ch.push_back(token(rng));
      corpus.remove_external_corpus("ext");
      corpus.add_external_corpus("ext", std::make_unique<SuffixAutomaton>(chunks));
    }
    if (it % 700 == 0) {
      corpus.erase_match_state({0, 1, 2, 99});
      for (int r = 0; r < 3; ++r) streams[r].clear();
    }
    if (it == 1500) {
      corpus.reset();
      for (auto& s : streams) s.clear();
    }
    if (it % 100 == 0) corpus.synchronize();
  }
  corpus.synchronize();
  done.store(true);
  getter.join();
  CorpusStats s = corpus.stats();
  if (s.nodes > c.capacity) fail("capacity");
  if (s.evictions == 0) fail("expected evictions");
}

// Whether the subtrees under a and b hold the same tokens and counts, children in the
// same (recency) order.
bool same_subtree(const Trie& a, int32_t na, const Trie& b, int32_t nb) {
  std::vector<Child> ka, kb;
  a.children(na, ka, std::numeric_limits<size_t>::max());
  b.children(nb, kb, std::numeric_limits<size_t>::max());
  if (ka.size() != kb.size()) return false;
  for (size_t i = 0; i < ka.size(); ++i)
    if (ka[i].token != kb[i].token || ka[i].count != kb[i].count || !same_subtree(a, ka[i].id, b, kb[i].id))
      return false;
  return true;
}

// A trie whose stamps are renumbered every few hundred stamps (alone, and between queue
// compactions) must evict exactly what the default one evicts.
void renumbering_keeps_lru_order() {
  const int depth = 6;
  const int64_t capacity = 200;
  for (uint32_t limit : {400u, 1000u, 6000u}) {
    Trie plain(depth, capacity), renumbered(depth, capacity, limit);
    Trie::Suffixes sp, sr;
    Rng rng{limit};
    std::vector<int32_t> stream;
    for (int it = 0; it < 4000; ++it) {
      int add = 1 + static_cast<int>(rng.next(4));
      const int64_t first_new = static_cast<int64_t>(stream.size());
      for (int j = 0; j < add; ++j) stream.push_back(static_cast<int32_t>(rng.next(it % 2000 < 1000 ? 5 : 9)));
      if (rng.next(10) == 0) sp.known = sr.known = 0;  // a fresh stream now and then
      plain.insert(stream.data(), static_cast<int64_t>(stream.size()), first_new, sp);
      renumbered.insert(stream.data(), static_cast<int64_t>(stream.size()), first_new, sr);
      if (stream.size() > 64) stream.erase(stream.begin(), stream.end() - depth);
    }
    if (plain.evictions() == 0 || plain.evictions() != renumbered.evictions() || plain.size() != renumbered.size())
      fail("renumbering: evictions");
    if (!same_subtree(plain, Trie::kRoot, renumbered, Trie::kRoot)) fail("renumbering: trie");
  }
}

}  // namespace

int main() {
  renumbering_keeps_lru_order();
  run(Match::kBfs);
  run(Match::kProb);
  run(Match::kProb, /*skewed=*/true);
  std::printf("ok\n");
  return 0;
}
