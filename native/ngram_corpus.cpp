// NgramCorpus: the put worker, per-request match state, and draft tree building.
//
// A draft tree is built from match "passes". The longest suffix of the tail (at most
// max_trie_depth-1 tokens) whose trie node has children gives the first pass; while the
// tree has fewer than N nodes, each shorter suffix with children adds a pass, then each
// external corpus (in the order they were added) does the same with its own matches. A
// pass walks its source from the matched node and grafts the paths into the tree; a
// path already in the tree (same tokens from the root) is reused, not added again, so
// shorter matches fill in what the longer ones lacked.
#include <algorithm>
#include <limits>
#include <queue>
#include <type_traits>

#include "ngram_corpus.h"

namespace spectool {

namespace {

// The draft tree of one request, written straight into the output row.
struct Tree {
  int32_t* tokens;
  int32_t* parents;
  float* scores;
  int* fanout;    // children per tree node
  int n;          // budget: N nodes including the root
  int size = 1;
  bool merging = false;  // false during the first pass: every path is new then

  bool full() const { return size >= n; }
  int find(int parent, int32_t token) const {
    if (!merging) return -1;
    for (int i = 1; i < size; ++i)
      if (parents[i] == parent && tokens[i] == token) return i;
    return -1;
  }
  int add(int32_t token, int parent, double score) {
    tokens[size] = token;
    parents[size] = parent;
    scores[size] = static_cast<float>(score);
    fanout[size] = 0;
    ++fanout[parent];
    return size++;
  }
};

// Breadth-first: the first `breadth` children of every node, in the source's order;
// score = 1 / (rank among the siblings taken + 1). A tree node that already has
// `breadth` children (from earlier passes) takes no new ones, only reuses. Children are
// read only until the tree is full (what follows could only be queued, never expanded).
template <class Source>
void bfs_pass(const Source& src, int32_t start, int breadth, Tree& tree,
              std::vector<std::pair<int32_t, int>>& queue) {
  queue.clear();
  queue.emplace_back(start, 0);
  for (size_t head = 0; head < queue.size() && !tree.full(); ++head) {
    auto [id, at] = queue[head];
    int rank = 0;
    src.for_each_child(id, [&](const Child& c) {
      int idx = tree.find(at, c.token);
      if (idx < 0 && tree.fanout[at] < breadth) idx = tree.add(c.token, at, 1.0 / static_cast<double>(rank + 1));
      if (idx >= 0) queue.emplace_back(c.id, idx);
      return ++rank < breadth && !tree.full();
    });
  }
}

// The `keep` (>= 1) most frequent children of a node into top[0..kept) (count descending, ties
// in the source's order) and the sum of all its children's counts, in one walk of the sibling
// list: no copy of the children, no sort of them all. Stops after `limit` children and returns
// false when there were more (out then holds those read so far).
template <class Source>
bool top_children(const Source& src, int32_t id, size_t keep, Child* top, TopChildren& out,
                  int64_t limit = std::numeric_limits<int64_t>::max()) {
  out = TopChildren{};
  int64_t read = 0;
  bool complete = true;
  src.for_each_child(id, [&](const Child& c) {
    if (read == limit) {
      complete = false;
      return false;
    }
    ++read;
    out.sum += c.count;
    if (out.kept == 0) {  // the first child: the only one of most expanded nodes
      top[0] = c;
      out.kept = 1;
    } else if (out.kept < keep || c.count > top[out.kept - 1].count) {
      // After every kept child of a count >= c's (a stable sort by count, descending); when all
      // `keep` are taken, the last one makes room.
      size_t pos = out.kept < keep ? out.kept++ : out.kept - 1;
      for (; pos > 0 && top[pos - 1].count < c.count; --pos) top[pos] = top[pos - 1];
      top[pos] = c;
    }
    return true;
  });
  return complete;
}

// Best-first by path probability, the product of count shares among siblings. A trie node with
// many children is expanded from its ranked children (Trie::rank_children) instead of a walk.
// One loop expands a node and pops the next (the start first), so the expansion is inlined.
template <class Source>
void prob_pass(Source& src, int32_t start, Tree& tree, ProbScratch& scratch) {
  std::vector<Candidate>& heap = scratch.heap;
  heap.clear();
  uint64_t seq = 0;
  // A child ranked r among its siblings is popped only after the r before it, each of which
  // adds a node (at most n - size more) or reuses one of the tree node's children: a child
  // ranked below that can never be reached, so only the top are pushed.
  const size_t most = static_cast<size_t>(tree.n - 1);
  if (scratch.top.size() < most) scratch.top.resize(most);
  int32_t id = start;  // the source node to expand, its tree node and its path probability
  int at = 0;
  double prob = 1.0;
  while (true) {
    const size_t reach = static_cast<size_t>(tree.n - tree.size + tree.fanout[at]);
    const Child* top = scratch.top.data();
    TopChildren t;
    const RankedChildren::Entry* ranked = nullptr;
    bool can_rank = false;
    if constexpr (std::is_same_v<Source, Trie>) {
      ranked = src.ranked(id);
      can_rank = src.can_rank();
    }
    // Most expanded nodes have a few children (long contexts): a walk of them costs less than
    // keeping them ranked, so a node is ranked once a walk finds it has more. Where no ranking can
    // be added (the table is full, or the source keeps none) one walk reads them all.
    if (ranked == nullptr) {
      const int64_t limit = can_rank ? RankedChildren::kWide : std::numeric_limits<int64_t>::max();
      if (!top_children(src, id, reach, scratch.top.data(), t, limit)) {
        if constexpr (std::is_same_v<Source, Trie>) ranked = src.rank_children(id);
      }
    }
    if (ranked != nullptr) {
      top = ranked->top.data();
      t = TopChildren{ranked->sum, std::min(ranked->top.size(), reach)};
    }
    Candidate next;
    bool has_next = false;
    for (size_t i = 0; i < t.kept; ++i) {
      const Child& c = top[i];
      const Candidate cand{prob * static_cast<double>(c.count) / static_cast<double>(t.sum), seq++, c.id, c.token, at};
      // The most frequent child beating everything queued (strictly: a tie goes to the earlier
      // push) is the next pop: it skips the heap (most expansions have one child, a long chain).
      if (i == 0 && (heap.empty() || heap.front() < cand)) {
        next = cand;
        has_next = true;
        continue;
      }
      heap.push_back(cand);
      std::push_heap(heap.begin(), heap.end());
    }
    if (!has_next) {
      if (heap.empty()) return;
      std::pop_heap(heap.begin(), heap.end());
      next = heap.back();
      heap.pop_back();
    }
    // A tree node without children has none to reuse (the common case: a chain of new nodes).
    int idx = tree.fanout[next.parent] > 0 ? tree.find(next.parent, next.token) : -1;
    if (idx < 0) idx = tree.add(next.token, next.parent, next.prob);
    if (tree.full()) return;  // a full tree would only queue the children
    id = next.id;
    at = idx;
    prob = next.prob;
  }
}

}  // namespace

NgramCorpus::NgramCorpus(const CorpusConfig& config)
    : config_(config),
      trie_(config.max_trie_depth, config.capacity,
            config.match == Match::kProb ? static_cast<size_t>(config.num_draft_tokens - 1) : 0),
      worker_([this] { worker_loop(); }) {}

NgramCorpus::~NgramCorpus() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  worker_.join();
}

void NgramCorpus::put(TokenBatch windows, std::vector<int64_t> req_ids, std::vector<int64_t> total_lens) {
  PutJob job{std::move(windows), std::move(req_ids), std::move(total_lens)};
  {
    std::unique_lock<std::mutex> lock(queue_mu_);
    // A few windows cost less to insert here than the wake-up of the worker thread
    // (and of the caller again in synchronize) costs; order is kept because nothing
    // is queued or running.
    if (job.windows.tokens.size() <= kInlinePutTokens && queue_.empty() && !busy_) {
      busy_ = true;
      lock.unlock();
      apply_put(job);
      lock.lock();
      busy_ = false;
      idle_cv_.notify_all();
      return;
    }
    queue_.push_back(std::move(job));
  }
  queue_cv_.notify_one();
}

void NgramCorpus::synchronize() {
  std::unique_lock<std::mutex> lock(queue_mu_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

void NgramCorpus::worker_loop() {
  std::unique_lock<std::mutex> lock(queue_mu_);
  while (true) {
    queue_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left to do
    PutJob job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    apply_put(job);
    lock.lock();
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void NgramCorpus::apply_put(const PutJob& job) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t keep = config_.max_trie_depth - 1;
  for (int64_t i = 0; i < job.windows.size(); ++i) {
    const int32_t* w = job.windows.data(i);
    const int64_t len = job.windows.len(i);
    ++puts_;
    if (job.req_ids.empty()) {
      scratch_suf_.known = 0;
      trie_.insert(w, len, 0, scratch_suf_);
      continue;
    }
    RequestState& st = requests_[job.req_ids[i]];
    const int64_t total = job.total_lens[i];
    const int64_t start = total - len;  // request position of the window's first token
    if (total <= st.done) continue;
    const int64_t first_new = std::max(st.done, start) - start;
    // The stored suffix nodes describe the stream just before first_new only if the
    // window continues it: no gap, and the overlapping tokens agree.
    int64_t overlap = std::min<int64_t>(first_new, static_cast<int64_t>(st.last.size()));
    bool continues = st.done >= start &&
                     std::equal(w + first_new - overlap, w + first_new, st.last.end() - overlap);
    st.suf.known = continues ? static_cast<int>(std::min<int64_t>(st.suf.known, overlap)) : 0;
    trie_.insert(w, len, first_new, st.suf);
    st.done = total;
    st.last.assign(w + len - std::min(len, keep), w + len);
  }
}

int NgramCorpus::breadth_for(int match_len) const {
  // Linear from max breadth at match length 1 to min breadth at max_trie_depth-1.
  int span = config_.max_trie_depth - 2;
  if (span <= 0) return config_.max_bfs_breadth;
  int m = std::clamp(match_len, 1, config_.max_trie_depth - 1);
  return config_.max_bfs_breadth - (config_.max_bfs_breadth - config_.min_bfs_breadth) * (m - 1) / span;
}

// chain_[k] = trie node of the tail's last k tokens (-1: none), or kUnknown where it was
// not derived from the request's put state; build_tree looks those up from the root
// when it needs them. Derived entries are exact: a stored suffix node is used only if it
// is still alive, and a missing node has no descendants (no node is left dangling).
constexpr int32_t kUnknown = -2;

void NgramCorpus::match_chain(const int32_t* tail, int64_t len, const RequestState* st, int64_t total_len) {
  const int depth = config_.max_trie_depth;
  chain_.assign(static_cast<size_t>(depth), kUnknown);
  chain_[0] = Trie::kRoot;
  // Tail tokens past what was put; a few are cheaper to follow than a fresh match.
  const int64_t added = st ? total_len - st->done : -1;
  if (!st || added < 0 || added > 2 || added >= len) return;
  const int64_t overlap = std::min<int64_t>(len - added, static_cast<int64_t>(st->last.size()));
  if (!std::equal(tail + len - added - overlap, tail + len - added, st->last.end() - overlap)) return;
  const int base = static_cast<int>(std::min<int64_t>(st->suf.known, overlap));
  for (int k = 1; k <= base; ++k)
    if (trie_.alive(st->suf, k)) chain_[k] = st->suf.id[k];
  int known = base;
  for (int64_t j = len - added; j < len; ++j) {
    known = std::min(known + 1, depth - 1);
    for (int k = known; k >= 1; --k) {
      int32_t p = chain_[k - 1];
      chain_[k] = p == kUnknown ? kUnknown : trie_.child(p, tail[j]);
    }
  }
}

void NgramCorpus::build_tree(const int32_t* tail, int64_t len, int64_t row, const DraftBuffers& out) {
  const int n = config_.num_draft_tokens;
  const bool bfs = config_.match == Match::kBfs;
  fanout_.assign(static_cast<size_t>(n), 0);
  Tree tree{out.tokens + row * n, out.parents + row * n, out.scores + row * n, fanout_.data(), n};
  tree.tokens[0] = tail[len - 1];
  tree.parents[0] = -1;
  tree.scores[0] = 1.0f;
  int match_len = 0, breadth = 0;

  auto run_pass = [&](auto& src, int32_t start, int m) {
    int b = breadth_for(m);
    if (bfs)
      bfs_pass(src, start, b, tree, bfs_queue_);
    else
      prob_pass(src, start, tree, prob_scratch_);
    if (match_len == 0) {
      match_len = m;
      breadth = b;
    }
    tree.merging = true;
  };

  const int k_max = static_cast<int>(std::min<int64_t>(len, config_.max_trie_depth - 1));
  for (int m = k_max; m >= 1 && !tree.full(); --m) {
    int32_t node = chain_[m];
    if (node == kUnknown) {
      node = Trie::kRoot;
      for (int64_t j = len - m; node >= 0 && j < len; ++j) node = trie_.child(node, tail[j]);
    }
    if (node >= 0 && trie_.has_children(node)) run_pass(trie_, node, m);
  }

  for (const auto& [name, sam] : external_) {
    if (tree.full()) break;
    // Longest suffix of the tail's last k_max tokens that occurs in the corpus.
    int32_t state = 0;
    int l = 0;
    for (int64_t j = len - k_max; j < len; ++j) {
      while (state != 0 && sam->next(state, tail[j]) < 0) {
        state = sam->link(state);
        l = sam->len(state);
      }
      int32_t nxt = sam->next(state, tail[j]);
      if (nxt >= 0) {
        state = nxt;
        ++l;
      }
    }
    // One pass per suffix length; lengths in one state share their continuations, so a
    // repeat with the same state and breadth would add nothing and is skipped.
    int32_t last_state = -1;
    int last_breadth = -1;
    for (int m = l; m >= 1 && !tree.full(); --m) {
      while (sam->len(sam->link(state)) >= m) state = sam->link(state);
      if (!sam->has_children(state)) continue;
      int b = bfs ? breadth_for(m) : 0;
      if (state == last_state && b == last_breadth) continue;
      run_pass(*sam, state, m);
      last_state = state;
      last_breadth = b;
    }
  }

  if (!bfs) {  // prob: report the widest fan-out in the tree
    breadth = *std::max_element(fanout_.begin(), fanout_.begin() + tree.size);
  }
  out.match_len[row] = match_len;
  out.breadth[row] = breadth;

  bool* valid = out.valid + row * n;
  bool* mask = out.mask + row * n * n;
  std::fill(mask, mask + n * n, false);
  for (int i = 0; i < n; ++i) {
    valid[i] = i < tree.size;
    if (!valid[i]) {  // padding hangs off the root
      tree.tokens[i] = 0;
      tree.parents[i] = 0;
      tree.scores[i] = 0.0f;
    }
    if (i > 0) std::copy(mask + tree.parents[i] * n, mask + tree.parents[i] * n + i, mask + i * n);
    mask[i * n + i] = true;
  }
}

void NgramCorpus::get(const TokenBatch& tails, const std::vector<int64_t>& req_ids,
                      const std::vector<int64_t>& total_lens, const DraftBuffers& out) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool cached = !req_ids.empty() && !total_lens.empty();
  for (int64_t i = 0; i < tails.size(); ++i) {
    const int32_t* tail = tails.data(i);
    int64_t len = tails.len(i);
    const RequestState* st = nullptr;
    if (cached) {
      auto it = requests_.find(req_ids[i]);
      if (it != requests_.end()) st = &it->second;
    }
    match_chain(tail, len, st, cached ? total_lens[i] : 0);
    build_tree(tail, len, i, out);
    ++gets_;
  }
}

void NgramCorpus::erase_match_state(const std::vector<int64_t>& req_ids) {
  synchronize();  // puts queued before the erase still see the old state
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t id : req_ids) {
    requests_.erase(id);
  }
}

void NgramCorpus::reset() {
  synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  trie_.clear();
  requests_.clear();
  puts_ = gets_ = 0;
}

bool NgramCorpus::add_external_corpus(const std::string& id, std::unique_ptr<SuffixAutomaton> sam) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : external_)
    if (e.first == id) return false;
  external_.emplace_back(id, std::move(sam));
  return true;
}

bool NgramCorpus::remove_external_corpus(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(external_.begin(), external_.end(), [&](const auto& e) { return e.first == id; });
  if (it == external_.end()) return false;
  external_.erase(it);
  return true;
}

std::vector<std::pair<std::string, int64_t>> NgramCorpus::list_external_corpora() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& e : external_) out.emplace_back(e.first, e.second->tokens());
  return out;
}

CorpusStats NgramCorpus::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t ext_tokens = 0;
  for (const auto& e : external_) ext_tokens += e.second->tokens();
  return CorpusStats{trie_.size(), config_.capacity, trie_.evictions(), puts_, gets_,
                     static_cast<int64_t>(external_.size()), ext_tokens, trie_.bytes_per_node()};
}

}  // namespace spectool
