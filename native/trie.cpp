// The n-gram trie: counts, recency order of siblings, and LRU eviction of leaves.
#include <algorithm>
#include <limits>

#include "huge_pages.h"
#include "ngram_corpus.h"

namespace spectool {

Trie::Trie(int max_depth, int64_t capacity, size_t ranked_keep, uint32_t stamp_limit)
    : max_depth_(max_depth), capacity_(capacity), stamp_limit_(stamp_limit), ranked_(ranked_keep) {
  clear();
}

void Trie::clear() {
  nodes_.clear();
  nodes_.shrink_to_fit();
  free_.clear();
  free_.shrink_to_fit();
  index_.clear();
  queue_.clear();
  queue_.shrink_to_fit();
  base_ = 1;
  head_ = 0;
  queue_peak_ = 0;
  orphans_ = {};
  ranked_.clear();
  // Reserved address space is not memory until touched: reserving up to capacity (at
  // most 16M nodes) spares the trie the copies of vector doubling and keeps the arrays
  // in the huge pages advised below (a reallocation would lose them). Within a position
  // the trie goes over capacity before evicting, by at most what one position creates:
  // n nodes for each n-gram length n (its missing prefix path and itself).
  const size_t most = static_cast<size_t>(std::min<int64_t>(capacity_, int64_t{1} << 24)) + 1 +
                      static_cast<size_t>(max_depth_) * static_cast<size_t>(max_depth_ + 1) / 2;
  nodes_.reserve(most);
  queue_.reserve(2 * most + 4097);  // compact_queue keeps it within 2 * size_ + 4096 before a push
  advise_huge_pages(nodes_.data(), nodes_.capacity() * sizeof(Node));
  advise_huge_pages(queue_.data(), queue_.capacity() * sizeof(int32_t));
  nodes_.push_back(Node{-1, -1, -1, -1, -1, 0, 0, 0});  // the root: the empty n-gram
  size_ = 0;
  evictions_ = 0;
}

void Trie::insert(const int32_t* w, int64_t len, int64_t first_new, Suffixes& suf) {
  suf.id.resize(static_cast<size_t>(max_depth_));
  suf.gen.resize(static_cast<size_t>(max_depth_));
  suf.id[0] = kRoot;
  int known = static_cast<int>(std::min<int64_t>(suf.known, first_new));
  for (int64_t j = first_new; j < len; ++j) {
    const int32_t t = w[j];
    const int m = static_cast<int>(std::min<int64_t>(max_depth_, j + 1));
    // The lookups of one position are independent: start their cache misses together.
    for (int n = 1; n <= m; ++n)
      if (n - 1 <= known) index_.prefetch(NodeIndex::hash(suf.id[n - 1], t));
    // Longest n first, so suf.id[n-1] (the old suffix) is read before id[n] is replaced.
    for (int n = m; n >= 1; --n) {
      int32_t parent = n - 1 <= known && alive(suf, n - 1) ? suf.id[n - 1] : ensure_path(w + j - n + 1, n - 1);
      int32_t c = child(parent, t);
      if (c < 0)
        c = create(parent, t);
      else
        move_to_front(c);
      const bool grew = nodes_[c].count < UINT32_MAX;
      if (grew) ++nodes_[c].count;
      stamp(c);
      if (ranked_.enabled()) ranked_.counted(parent, Child{c, t, nodes_[c].count}, grew);
      if (n < max_depth_) {
        suf.id[n] = c;
        suf.gen[n] = nodes_[c].gen;
      }
    }
    known = std::min(m, max_depth_ - 1);
    evict_over_capacity();
  }
  suf.known = known;
}

int32_t Trie::ensure_path(const int32_t* tokens, int64_t n) {
  int32_t node = kRoot;
  for (int64_t i = 0; i < n; ++i) {
    int32_t c = child(node, tokens[i]);
    if (c < 0) {  // it did occur: an evicted (or never put) prefix counts once
      c = create(node, tokens[i]);
      nodes_[c].count = 1;
      stamp(c);
      if (ranked_.enabled()) ranked_.counted(node, Child{c, tokens[i], 1}, true);
    }
    node = c;
  }
  return node;
}

int32_t Trie::create(int32_t parent, int32_t token) {
  int32_t id;
  uint32_t gen = 0;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
    gen = nodes_[id].gen;
  } else {
    id = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[id] = Node{token, parent, -1, -1, -1, gen, 0, 0};
  index_.insert(NodeIndex::hash(parent, token), id);
  const Node& p = nodes_[parent];
  if (p.first_child < 0 && parent != kRoot && queued(p.stamp)) queue_[p.stamp - base_] = ~parent;  // no longer a leaf
  sibling_push_front(id);
  ++size_;
  return id;
}

void Trie::stamp(int32_t id) {
  if (queue_.size() > 2 * static_cast<size_t>(size_) + 4096) compact_queue();
  if (base_ + queue_.size() >= stamp_limit_) renumber_stamps();
  Node& n = nodes_[id];
  if (queued(n.stamp)) queue_[n.stamp - base_] = kStale;
  n.stamp = base_ + static_cast<uint32_t>(queue_.size());
  queue_.push_back(n.first_child < 0 ? id : ~id);
  queue_peak_ = std::max(queue_peak_, queue_.size());
}

void Trie::move_to_front(int32_t id) {
  if (nodes_[nodes_[id].parent].first_child == id) return;
  sibling_unlink(id);
  sibling_push_front(id);
}

// Victims mostly come in chains (a leaf, then its parent, which just became the oldest
// leaf, ...), so finding each one waits for the previous one's node. Their index slots
// are independent of that chain: evict_one only starts loading them, and they are erased
// together once the trie is back within capacity (nothing looks them up in between).
void Trie::evict_over_capacity() {
  while (size_ > capacity_) evict_one();
  for (const auto& [h, id] : unindexed_) index_.erase(h, id);
  unindexed_.clear();
}

// Evicts the leaf with the oldest stamp (erasing its index entry is left to the caller). Queue entries are in stamp order and the
// first one that still names a node (not kStale, not ~id) is the oldest leaf with an
// entry, found without touching any node. A node that loses its last child gets its
// entry back if the entry is still queued, and otherwise goes to orphans_, a heap by
// stamp: every leaf is thus in exactly one of the two, and the older front is the victim.
void Trie::evict_one() {
  while (head_ < queue_.size() && queue_[head_] < 0) ++head_;
  while (!orphans_.empty()) {
    const Node& n = nodes_[orphans_.top().second];
    if (n.stamp == orphans_.top().first && n.first_child < 0) break;
    orphans_.pop();
  }
  int32_t id;
  if (!orphans_.empty() && (head_ == queue_.size() || orphans_.top().first < base_ + head_)) {
    id = orphans_.top().second;
    orphans_.pop();
  } else {
    id = queue_[head_++];
  }
  Node& n = nodes_[id];
  const int32_t parent = n.parent;
  if (ranked_.enabled()) ranked_.evicted(parent, id, n.count);
  sibling_unlink(id);
  const uint32_t h = NodeIndex::hash(parent, n.token);
  index_.prefetch(h);
  unindexed_.emplace_back(h, id);
  n.stamp = 0;
  ++n.gen;
  free_.push_back(id);
  --size_;
  ++evictions_;
  const Node& p = nodes_[parent];
  if (parent != kRoot && p.first_child < 0) {  // the parent is now a leaf
    if (queued(p.stamp))
      queue_[p.stamp - base_] = parent;
    else
      orphans_.emplace(p.stamp, parent);
  }
  // The next victim is likely the next named entry: start loading its node now, so the
  // next eviction (often after the next position's lookups) finds it in cache.
  for (size_t i = head_, end = std::min(queue_.size(), size_t{head_} + 16); i < end; ++i)
    if (queue_[i] >= 0) {
      __builtin_prefetch(&nodes_[queue_[i]]);
      break;
    }
}

// Drops the consumed and stale entries, giving the queued nodes consecutive stamps from
// base_ + head_ on. Stamps only decrease and keep their order, and every stamp of a node
// without a queued entry (orphans, nodes passed over) stays below the new ones.
void Trie::compact_queue() {
  const uint32_t first = base_ + head_;
  size_t out = 0;
  for (size_t i = head_; i < queue_.size(); ++i) {
    const int32_t e = queue_[i];
    if (e == kStale) continue;
    nodes_[e >= 0 ? e : ~e].stamp = first + static_cast<uint32_t>(out);
    queue_[out++] = e;
  }
  queue_.resize(out);
  base_ = first;
  head_ = 0;
}

// Before the 32-bit clock runs out: gives every node the rank of its stamp (1, 2, ...)
// and rebuilds the queue over all of them, which also empties orphans_.
void Trie::renumber_stamps() {
  std::vector<std::pair<uint32_t, int32_t>> order;
  order.reserve(static_cast<size_t>(size_));
  for (size_t id = 1; id < nodes_.size(); ++id)
    if (nodes_[id].stamp != 0) order.emplace_back(nodes_[id].stamp, static_cast<int32_t>(id));
  std::sort(order.begin(), order.end());
  queue_.clear();
  base_ = 1;
  head_ = 0;
  for (const auto& [old, id] : order) {
    nodes_[id].stamp = base_ + static_cast<uint32_t>(queue_.size());
    queue_.push_back(nodes_[id].first_child < 0 ? id : ~id);
  }
  orphans_ = {};
}

const RankedChildren::Entry* Trie::rank_children(int32_t node) {
  if (!ranked_.enabled() || ranked_.full()) return nullptr;
  children(node, rank_scratch_, std::numeric_limits<size_t>::max());
  return ranked_.add(node, rank_scratch_);
}

void Trie::children(int32_t node, std::vector<Child>& out, size_t limit) const {
  out.clear();
  if (limit == 0) return;
  for_each_child(node, [&](const Child& c) {
    out.push_back(c);
    return out.size() < limit;
  });
}

void Trie::sibling_unlink(int32_t id) {
  Node& n = nodes_[id];
  if (n.prev_sibling >= 0) nodes_[n.prev_sibling].next_sibling = n.next_sibling;
  else nodes_[n.parent].first_child = n.next_sibling;
  if (n.next_sibling >= 0) nodes_[n.next_sibling].prev_sibling = n.prev_sibling;
  n.prev_sibling = n.next_sibling = -1;
}

void Trie::sibling_push_front(int32_t id) {
  Node& n = nodes_[id];
  Node& p = nodes_[n.parent];
  n.prev_sibling = -1;
  n.next_sibling = p.first_child;
  if (p.first_child >= 0) nodes_[p.first_child].prev_sibling = id;
  p.first_child = id;
}

double Trie::bytes_per_node() const {
  // Memory in use: vector capacity past the elements ever stored is address space that
  // was never touched, so nodes and queue count by their high-water marks.
  double total = static_cast<double>(nodes_.size() * sizeof(Node) + free_.capacity() * sizeof(int32_t) +
                                     index_.bytes() + queue_peak_ * sizeof(int32_t) +
                                     orphans_.size() * sizeof(std::pair<uint32_t, int32_t>) + ranked_.bytes());
  return total / static_cast<double>(std::max<int64_t>(1, size_));
}

}  // namespace spectool
