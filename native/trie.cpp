// The n-gram trie: counts, recency order of siblings, and LRU eviction of leaves.
#include <algorithm>

#include "ngram_corpus.h"

namespace spectool {

Trie::Trie(int max_depth, int64_t capacity) : max_depth_(max_depth), capacity_(capacity) { clear(); }

void Trie::clear() {
  nodes_.clear();
  nodes_.shrink_to_fit();
  free_.clear();
  free_.shrink_to_fit();
  index_.clear();
  nodes_.push_back(Node{-1, -1, -1, -1, -1, -1, -1, 0, 0, 0});  // the root: the empty n-gram
  lru_head_ = lru_tail_ = -1;
  size_ = 0;
  evictions_ = 0;
  walk_ = 0;
  ++version_;
}

void Trie::insert(const int32_t* w, int64_t len, int64_t first_new) {
  for (int64_t i = std::max<int64_t>(0, first_new - max_depth_ + 1); i < len; ++i) {
    ++walk_;
    int32_t node = kRoot;
    int32_t cursor = -1;  // nodes of this walk sit at the front of the LRU list, shallow first
    int64_t end = std::min<int64_t>(len, i + max_depth_);
    for (int64_t j = i; j < end; ++j) {
      int32_t c = child(node, w[j]);
      bool created = c < 0;
      if (created) c = create(node, w[j], cursor);
      touch(c, cursor);
      if (j >= first_new)
        ++nodes_[c].count;
      else if (created)
        nodes_[c].count = 1;  // a prefix that was evicted or never put: it did occur
      cursor = c;
      node = c;
    }
  }
}

int32_t Trie::create(int32_t parent, int32_t token, int32_t cursor) {
  // The LRU tail is older than every node of the current walk, and capacity >= depth
  // means the walk alone never fills the trie, so the evicted leaf is never on it.
  if (size_ >= capacity_) evict_lru_leaf();
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    id = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[id] = Node{token, parent, -1, -1, -1, -1, -1, nodes_[parent].depth + 1, 0, walk_};
  index_.put(FlatMap::key(parent, token), id);
  sibling_push_front(id);
  lru_insert_after(cursor, id);
  ++size_;
  ++version_;
  return id;
}

void Trie::evict_lru_leaf() {
  int32_t id = lru_tail_;
  Node& n = nodes_[id];
  lru_unlink(id);
  sibling_unlink(id);
  index_.erase(FlatMap::key(n.parent, n.token));
  free_.push_back(id);
  --size_;
  ++evictions_;
  ++version_;
}

void Trie::touch(int32_t id, int32_t cursor) {
  Node& n = nodes_[id];
  n.walk = walk_;
  if (nodes_[n.parent].first_child != id) {
    sibling_unlink(id);
    sibling_push_front(id);
  }
  if (n.lru_prev != cursor) {
    lru_unlink(id);
    lru_insert_after(cursor, id);
  }
}

void Trie::children(int32_t node, std::vector<Child>& out, size_t limit) const {
  out.clear();
  for (int32_t c = nodes_[node].first_child; c >= 0 && out.size() < limit; c = nodes_[c].next_sibling)
    out.push_back(Child{c, nodes_[c].token, nodes_[c].count});
}

void Trie::lru_unlink(int32_t id) {
  Node& n = nodes_[id];
  if (n.lru_prev >= 0) nodes_[n.lru_prev].lru_next = n.lru_next; else lru_head_ = n.lru_next;
  if (n.lru_next >= 0) nodes_[n.lru_next].lru_prev = n.lru_prev; else lru_tail_ = n.lru_prev;
  n.lru_prev = n.lru_next = -1;
}

void Trie::lru_insert_after(int32_t cursor, int32_t id) {
  Node& n = nodes_[id];
  int32_t next = cursor >= 0 ? nodes_[cursor].lru_next : lru_head_;
  n.lru_prev = cursor;
  n.lru_next = next;
  if (cursor >= 0) nodes_[cursor].lru_next = id; else lru_head_ = id;
  if (next >= 0) nodes_[next].lru_prev = id; else lru_tail_ = id;
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
  double total = static_cast<double>(nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(int32_t) +
                                     index_.bytes());
  return total / static_cast<double>(std::max<int64_t>(1, size_));
}

}  // namespace spectool
