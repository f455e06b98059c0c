// The n-gram corpus: a trie over token ids shared by all requests, optional external
// corpora (suffix automata), and the draft trees built from them.
//
// Semantics (mirrored by tests/ngram_reference.py, which is the oracle):
// - put: for every new position j of a window, the count of every n-gram w[j-n+1..j]
//   (n <= max_trie_depth, inside the window) goes up by one, longest n first. A prefix
//   w[j-n+1..j-1] that is missing (evicted, or never put) is recreated with count 1.
//   Every node created or counted is stamped with the next value of a global clock.
//   Counts saturate at UINT32_MAX; stamps are 32-bit and renumbered (order kept)
//   before they run out.
// - recency: siblings are ordered by stamp, newest first (an n-gram's stamp is the last
//   time it was counted, so "recent" means "occurred recently").
// - eviction: after each position, while the trie holds more than capacity nodes, the
//   leaf with the oldest stamp is evicted (a parent can be older than its children, so
//   only leaves are candidates; no node is ever left dangling).
// - get: see NgramCorpus::get.
//
// Cost: a request keeps the trie nodes of its stream's suffixes between puts, so a new
// token costs one child lookup per n (max_trie_depth lookups), not a walk from the root
// per n. Leaf LRU is a queue indexed by stamp whose entries say whether their node is
// still a leaf with that stamp, plus a small heap for nodes that become leaves after
// their queue entry went by (see Trie::evict_one).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flat_map.h"
#include "node_index.h"
#include "ranked_children.h"

namespace spectool {

enum class Match { kBfs, kProb };

struct CorpusConfig {
  int max_trie_depth = 18;
  int min_bfs_breadth = 1;
  int max_bfs_breadth = 10;
  int num_draft_tokens = 12;
  Match match = Match::kBfs;
  int64_t capacity = 10'000'000;
};

// What a PROB expansion of a node reads: the sum of all its children's counts and how many of
// its most frequent children were kept (in a caller's array, in the order they are pushed).
struct TopChildren {
  int64_t sum = 0;
  size_t kept = 0;
};

// A PROB candidate: a source node below tree node `parent`, by path probability (a max-heap).
struct Candidate {
  double prob;
  uint64_t seq;  // ties go to the earlier push
  int32_t id, token;
  int parent;
  bool operator<(const Candidate& o) const { return prob != o.prob ? prob < o.prob : seq > o.seq; }
};

struct ProbScratch {
  std::vector<Candidate> heap;
  std::vector<Child> top;  // an expansion's kept children (N - 1)
};

class Trie {
 public:
  // ranked_keep: how many top children to keep ranked for wide nodes (RankedChildren; 0: none).
  // stamp_limit: stamps stay below it; reaching it renumbers them (tests lower it; it
  // must exceed capacity + 1).
  Trie(int max_depth, int64_t capacity, size_t ranked_keep = 0, uint32_t stamp_limit = UINT32_MAX);

  // The trie nodes of a stream's suffixes: id[k] = node of its last k tokens for
  // k <= known (id[0] = root). A node evicted since is detected by its generation.
  struct Suffixes {
    std::vector<int32_t> id;
    std::vector<uint32_t> gen;
    int known = 0;
  };

  // Counts the n-grams of w[0..len) that end at positions >= first_new. `suf` holds the
  // suffix nodes of w[0..first_new) (only its first min(known, first_new) are used) and
  // is left holding those of w[0..len).
  void insert(const int32_t* w, int64_t len, int64_t first_new, Suffixes& suf);
  int32_t child(int32_t node, int32_t token) const {
    if (node < 0) return -1;
    return index_.find(NodeIndex::hash(node, token),
                       [&](int32_t id) { return nodes_[id].parent == node && nodes_[id].token == token; });
  }
  // Whether the suffix node suf.id[k] is still the node it was when stored.
  bool alive(const Suffixes& suf, int k) const {
    return k == 0 || nodes_[suf.id[k]].gen == suf.gen[k];
  }
  bool has_children(int32_t node) const { return nodes_[node].first_child >= 0; }
  // Calls visit(const Child&) for the children in recency order (most recently stamped
  // first) until it returns false. Each step of the sibling list waits for the previous
  // node, so a caller that needs fewer children than there are should stop early.
  template <class Visit>
  void for_each_child(int32_t node, Visit&& visit) const {
    for (int32_t c = nodes_[node].first_child; c >= 0; c = nodes_[c].next_sibling) {
      const Node& n = nodes_[c];
      // A tree builder expands children next: load their first children meanwhile, as
      // the walk along this sibling list cannot be overlapped with itself.
      if (n.first_child >= 0) __builtin_prefetch(&nodes_[n.first_child]);
      if (!visit(Child{c, n.token, n.count})) return;
    }
  }
  // The first `limit` children in recency order.
  void children(int32_t node, std::vector<Child>& out, size_t limit) const;
  // The ranked children of `node` if it has an entry (RankedChildren), else nullptr.
  const RankedChildren::Entry* ranked(int32_t node) const { return ranked_.find(node); }
  // Ranks the children of `node` (a walk of them all) and keeps them ranked from then on; nullptr
  // when ranking is off or the table is full.
  const RankedChildren::Entry* rank_children(int32_t node);
  // Whether rank_children can add an entry (ranking on and its table not full).
  bool can_rank() const { return ranked_.enabled() && !ranked_.full(); }
  void clear();

  int64_t size() const { return size_; }
  int64_t evictions() const { return evictions_; }
  double bytes_per_node() const;

  static constexpr int32_t kRoot = 0;

 private:
  // 32 bytes, aligned: two nodes per cache line and none straddles two.
  struct alignas(32) Node {
    int32_t token;
    int32_t parent;
    int32_t first_child, next_sibling, prev_sibling;  // siblings: newest stamp first
    uint32_t gen;    // bumped when the slot is freed
    uint32_t count;  // saturates at UINT32_MAX
    uint32_t stamp;  // 0 = free slot or the root (stamps start at 1)
  };
  static_assert(sizeof(Node) == 32, "two nodes per cache line");
  // queue_[i] describes stamp base_ + i: the node id while that node is a leaf stamped
  // then, ~id while it is not a leaf, kStale once the node was stamped again.
  static constexpr int32_t kStale = -1;

  int32_t create(int32_t parent, int32_t token);
  int32_t ensure_path(const int32_t* tokens, int64_t n);
  void stamp(int32_t id);
  void move_to_front(int32_t id);
  void evict_over_capacity();
  void evict_one();
  void sibling_unlink(int32_t id);
  void sibling_push_front(int32_t id);
  bool queued(uint32_t stamp) const { return stamp >= base_ + head_; }
  void compact_queue();
  void renumber_stamps();

  int max_depth_;
  int64_t capacity_;
  uint32_t stamp_limit_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;
  NodeIndex index_;
  std::vector<std::pair<uint32_t, int32_t>> unindexed_;  // (hash, id) of nodes evict_one freed
  // Every stamp appends an entry, so the next stamp is base_ + queue_.size(); entries
  // before head_ were consumed by evictions.
  std::vector<int32_t> queue_;
  uint32_t base_ = 1;
  uint32_t head_ = 0;
  // Leaves whose queue entry was passed over while they had children, by stamp.
  std::priority_queue<std::pair<uint32_t, int32_t>, std::vector<std::pair<uint32_t, int32_t>>,
                      std::greater<>> orphans_;
  size_t queue_peak_ = 0;  // most entries the queue held (its touched memory)
  int64_t size_ = 0;  // nodes, root excluded
  int64_t evictions_ = 0;
  RankedChildren ranked_;
  std::vector<Child> rank_scratch_;  // rank_children's walk
};

// Suffix automaton over the token chunks of one external corpus (chunks are joined by a
// separator that no tail can match, so no match spans two chunks).
class SuffixAutomaton {
 public:
  explicit SuffixAutomaton(const std::vector<std::vector<int32_t>>& chunks);

  int32_t next(int32_t state, int32_t token) const;  // -1 if no transition
  int32_t link(int32_t state) const { return states_[state].link; }
  int32_t len(int32_t state) const { return states_[state].len; }
  bool has_children(int32_t state) const {
    return states_[state].draft_end > states_[state].draft_begin;
  }
  // Calls visit(const Child&) for the children by occurrence count, descending, then
  // token ascending, until it returns false.
  template <class Visit>
  void for_each_child(int32_t state, Visit&& visit) const {
    const State& s = states_[state];
    for (int64_t i = s.draft_begin; i < s.draft_end; ++i) {
      const Edge& e = edges_[draft_order_[i]];
      if (!visit(Child{e.target, e.token, states_[e.target].occ})) return;
    }
  }
  // The first `limit` children in that order.
  void children(int32_t state, std::vector<Child>& out, size_t limit) const;
  int64_t tokens() const { return tokens_; }

 private:
  struct State {
    int32_t len = 0, link = -1;
    int64_t occ = 0;
    int64_t edge_begin = 0, edge_end = 0;    // edges_ sorted by token (lookup)
    int64_t draft_begin = 0, draft_end = 0;  // draft_order_ (drafting)
  };
  struct Edge {
    int32_t token, target;
  };
  std::vector<State> states_;
  std::vector<Edge> edges_;
  std::vector<int64_t> draft_order_;  // indices into edges_
  int64_t tokens_ = 0;
};

// Output of one batch_get, in caller-owned buffers (bs rows each).
struct DraftBuffers {
  int32_t* tokens;    // [bs, N]
  int32_t* parents;   // [bs, N]
  bool* mask;         // [bs, N, N]
  bool* valid;        // [bs, N]
  float* scores;      // [bs, N]
  int32_t* match_len; // [bs]
  int32_t* breadth;   // [bs]
};

// Token windows of one batch, flattened: window i is tokens[offsets[i] .. offsets[i+1]).
struct TokenBatch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  int64_t size() const { return static_cast<int64_t>(offsets.size()) - 1; }
  const int32_t* data(int64_t i) const { return tokens.data() + offsets[i]; }
  int64_t len(int64_t i) const { return offsets[i + 1] - offsets[i]; }
};

struct CorpusStats {
  int64_t nodes, capacity, evictions, puts, gets, external_corpora, external_tokens;
  double bytes_per_node;
};

class NgramCorpus {
 public:
  explicit NgramCorpus(const CorpusConfig& config);  // config must be valid (checked by the caller)
  ~NgramCorpus();
  NgramCorpus(const NgramCorpus&) = delete;
  NgramCorpus& operator=(const NgramCorpus&) = delete;

  // Queues the windows for the worker thread (a put of at most kInlinePutTokens tokens
  // is applied on the caller's thread when no other put is pending). With request ids,
  // total_lens[i] is the request's length including window i (its last tokens), and
  // only tokens past what was put before for that request are counted.
  void put(TokenBatch windows, std::vector<int64_t> req_ids, std::vector<int64_t> total_lens);
  void synchronize();
  static constexpr size_t kInlinePutTokens = 64;

  // Builds one draft tree per tail. req_ids/total_lens may be empty (no match cache).
  void get(const TokenBatch& tails, const std::vector<int64_t>& req_ids,
           const std::vector<int64_t>& total_lens, const DraftBuffers& out);

  void erase_match_state(const std::vector<int64_t>& req_ids);
  void reset();

  // Returns false if the id is taken.
  bool add_external_corpus(const std::string& id, std::unique_ptr<SuffixAutomaton> sam);
  bool remove_external_corpus(const std::string& id);
  std::vector<std::pair<std::string, int64_t>> list_external_corpora();

  CorpusStats stats();
  const CorpusConfig& config() const { return config_; }

 private:
  struct PutJob {
    TokenBatch windows;
    std::vector<int64_t> req_ids, total_lens;
  };
  // What was put for one request: its length so far, its last (up to depth-1) tokens
  // and their suffix nodes. Puts extend it; gets start their match from it.
  struct RequestState {
    int64_t done = 0;
    std::vector<int32_t> last;
    Trie::Suffixes suf;
  };

  void worker_loop();
  void apply_put(const PutJob& job);
  void match_chain(const int32_t* tail, int64_t len, const RequestState* st, int64_t total_len);
  void build_tree(const int32_t* tail, int64_t len, int64_t row, const DraftBuffers& out);
  int breadth_for(int match_len) const;

  CorpusConfig config_;
  Trie trie_;
  std::vector<std::pair<std::string, std::unique_ptr<SuffixAutomaton>>> external_;
  std::unordered_map<int64_t, RequestState> requests_;
  Trie::Suffixes scratch_suf_;   // puts without request ids
  std::vector<int32_t> chain_;   // scratch of get: chain_[k] = node of the tail's last k tokens
  ProbScratch prob_scratch_;  // scratch of build_tree (under mu_)
  std::vector<std::pair<int32_t, int>> bfs_queue_;
  std::vector<int> fanout_;
  int64_t puts_ = 0, gets_ = 0;

  std::mutex mu_;  // guards everything above
  std::mutex queue_mu_;
  std::condition_variable queue_cv_, idle_cv_;
  std::deque<PutJob> queue_;
  bool busy_ = false, stop_ = false;
  std::thread worker_;
};

}  // namespace spectool
