// Suffix automaton of an external corpus: every substring of every chunk is one path
// from state 0, and each state knows how often its strings occur (|endpos|).
#include <algorithm>

#include "ngram_corpus.h"

namespace spectool {

namespace {
constexpr int32_t kSeparator = -1;  // between chunks; tails hold only ids >= 0
}

SuffixAutomaton::SuffixAutomaton(const std::vector<std::vector<int32_t>>& chunks) {
  // Build with a hash map of transitions and per-state edge lists, then freeze into
  // sorted arrays (binary search for matching, count order for drafting).
  struct BuildEdge {
    int32_t token, target, next;
  };
  std::vector<BuildEdge> edges;
  std::vector<int32_t> first_edge{-1};
  FlatMap index;  // (state, token) -> index into edges
  states_.emplace_back();
  int32_t last = 0;

  auto add_state = [&](int32_t len, int32_t link, int64_t occ) {
    State s;
    s.len = len;
    s.link = link;
    s.occ = occ;
    states_.push_back(s);
    first_edge.push_back(-1);
    return static_cast<int32_t>(states_.size() - 1);
  };
  auto add_edge = [&](int32_t from, int32_t token, int32_t to) {
    edges.push_back(BuildEdge{token, to, first_edge[from]});
    first_edge[from] = static_cast<int32_t>(edges.size() - 1);
    index.put(FlatMap::key(from, token), first_edge[from]);
  };
  auto extend = [&](int32_t c) {
    int32_t cur = add_state(states_[last].len + 1, -1, 1);
    int32_t p = last;
    while (p >= 0 && index.find(FlatMap::key(p, c)) < 0) {
      add_edge(p, c, cur);
      p = states_[p].link;
    }
    if (p < 0) {
      states_[cur].link = 0;
    } else {
      int32_t q = edges[index.find(FlatMap::key(p, c))].target;
      if (states_[p].len + 1 == states_[q].len) {
        states_[cur].link = q;
      } else {
        int32_t clone = add_state(states_[p].len + 1, states_[q].link, 0);
        for (int32_t e = first_edge[q]; e >= 0; e = edges[e].next) add_edge(clone, edges[e].token, edges[e].target);
        for (; p >= 0; p = states_[p].link) {
          int32_t e = index.find(FlatMap::key(p, c));
          if (edges[e].target != q) break;
          edges[e].target = clone;
        }
        states_[q].link = clone;
        states_[cur].link = clone;
      }
    }
    last = cur;
  };

  bool first = true;
  for (const auto& chunk : chunks) {
    if (chunk.empty()) continue;
    if (!first) extend(kSeparator);
    first = false;
    for (int32_t t : chunk) extend(t);
    tokens_ += static_cast<int64_t>(chunk.size());
  }
  index.clear();

  // occ(link(v)) += occ(v), longest states first (counting sort by len).
  int32_t max_len = 0;
  for (const State& s : states_) max_len = std::max(max_len, s.len);
  std::vector<int32_t> bucket(static_cast<size_t>(max_len) + 2, 0);
  for (const State& s : states_) ++bucket[s.len + 1];
  for (size_t i = 1; i < bucket.size(); ++i) bucket[i] += bucket[i - 1];
  std::vector<int32_t> by_len(states_.size());
  for (int32_t v = 0; v < static_cast<int32_t>(states_.size()); ++v) by_len[bucket[states_[v].len]++] = v;
  for (auto it = by_len.rbegin(); it != by_len.rend(); ++it)
    if (states_[*it].link >= 0) states_[states_[*it].link].occ += states_[*it].occ;

  // Freeze the edges: per state, sorted by token; drafting order skips the separator.
  edges_.reserve(edges.size());
  draft_order_.reserve(edges.size());
  for (size_t v = 0; v < states_.size(); ++v) {
    State& s = states_[v];
    s.edge_begin = static_cast<int64_t>(edges_.size());
    for (int32_t e = first_edge[v]; e >= 0; e = edges[e].next) edges_.push_back(Edge{edges[e].token, edges[e].target});
    s.edge_end = static_cast<int64_t>(edges_.size());
    std::sort(edges_.begin() + s.edge_begin, edges_.end(),
              [](const Edge& a, const Edge& b) { return a.token < b.token; });
    s.draft_begin = static_cast<int64_t>(draft_order_.size());
    for (int64_t e = s.edge_begin; e < s.edge_end; ++e)
      if (edges_[e].token != kSeparator) draft_order_.push_back(e);
    s.draft_end = static_cast<int64_t>(draft_order_.size());
    std::sort(draft_order_.begin() + s.draft_begin, draft_order_.end(), [this](int64_t a, int64_t b) {
      int64_t oa = states_[edges_[a].target].occ, ob = states_[edges_[b].target].occ;
      return oa != ob ? oa > ob : edges_[a].token < edges_[b].token;
    });
  }
}

int32_t SuffixAutomaton::next(int32_t state, int32_t token) const {
  const State& s = states_[state];
  auto begin = edges_.begin() + s.edge_begin, end = edges_.begin() + s.edge_end;
  auto it = std::lower_bound(begin, end, token, [](const Edge& e, int32_t t) { return e.token < t; });
  return it != end && it->token == token ? it->target : -1;
}

void SuffixAutomaton::children(int32_t state, std::vector<Child>& out, size_t limit) const {
  out.clear();
  if (limit == 0) return;
  for_each_child(state, [&](const Child& c) {
    out.push_back(c);
    return out.size() < limit;
  });
}

}  // namespace spectool
