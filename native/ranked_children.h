// The most frequent children of the trie's wide nodes, kept up to date by the trie, so that a
// PROB expansion of a node with many children (a short, frequent context) reads its top children
// and their count sum at once instead of walking its whole sibling list.
//
// Order: count descending, then most recently counted first, which is the order a walk of the
// recency-ordered sibling list keeps them in (at equal counts the earlier sibling wins). An entry
// holds the first min(keep, children) children in that order and the sum of all children's counts.
// Counting or creating a child only raises that child in the order (its count grows or stays
// saturated, and it becomes the most recently counted), so the entry stays exact with bounded
// work: the child moves up inside it, or enters it at its place and pushes the last one out.
// Evicting a child the entry holds would need the next one from outside it: the entry is dropped
// then, and rebuilt from a walk at the node's next expansion.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace spectool {

// One child of a trie node or automaton state, as the tree builder sees it.
struct Child {
  int32_t id;
  int32_t token;
  int64_t count;
};

class RankedChildren {
 public:
  // A node gets an entry once an expansion finds it has more children than this: a shorter walk
  // costs less than keeping its entry up to date on every put (benchmarks/ngram_corpus.py: 12
  // made PROB's gets at bs 64 a tenth cheaper than 32, its puts no dearer).
  static constexpr int64_t kWide = 12;
  // Wide nodes beyond this many walk their children at every expansion, as narrow ones do.
  static constexpr size_t kMaxEntries = size_t{1} << 14;

  struct Entry {
    int64_t sum = 0;
    std::vector<Child> top;
  };

  // keep: the most children an expansion can use (N - 1); 0 turns the ranking off.
  explicit RankedChildren(size_t keep) : keep_(keep) {}

  bool enabled() const { return keep_ > 0; }
  bool full() const { return entries_.size() >= kMaxEntries; }
  const Entry* find(int32_t node) const {
    return marked(node) ? &entries_.find(node)->second : nullptr;
  }

  // The entry of `node` from all its children in sibling order (most recently counted first).
  const Entry* add(int32_t node, const std::vector<Child>& children) {
    Entry& e = entries_[node];
    e.sum = 0;
    for (const Child& c : children) e.sum += c.count;
    e.top = children;
    std::stable_sort(e.top.begin(), e.top.end(), [](const Child& a, const Child& b) { return a.count > b.count; });
    if (e.top.size() > keep_) {
      e.top.resize(keep_);
      e.top.shrink_to_fit();  // a node of thousands of children keeps only its top
    }
    mark(node, true);
    return &e;
  }

  // Child `c` of `parent` (its id, token and new count) was just counted or created and is now
  // the most recently counted; `grew`: its count went up by one (it had not saturated).
  void counted(int32_t parent, const Child& c, bool grew) {
    if (!marked(parent)) return;
    Entry& e = entries_.find(parent)->second;
    if (grew) ++e.sum;
    std::vector<Child>& top = e.top;
    size_t i = 0;
    while (i < top.size() && top[i].id != c.id) ++i;
    if (i == top.size()) {  // not held: it enters if it now ranks before the last held child
      if (top.size() == keep_) {
        if (top.back().count > c.count) return;
        top.pop_back();
        --i;
      }
      top.push_back(c);
    }
    top[i].count = c.count;
    for (; i > 0 && top[i - 1].count <= c.count; --i) std::swap(top[i - 1], top[i]);
  }

  // Child `child` of `parent`, of count `count`, was evicted.
  void evicted(int32_t parent, int32_t child, int64_t count) {
    drop(child);  // a wide node loses its entry with its last held child, before it is a leaf
    if (!marked(parent)) return;
    Entry& e = entries_.find(parent)->second;
    e.sum -= count;
    for (const Child& c : e.top)
      if (c.id == child) {
        drop(parent);
        return;
      }
  }

  void clear() {
    entries_.clear();
    bits_.clear();
  }

  // Memory held: the entries, their children and the table's buckets, and the marks.
  size_t bytes() const {
    size_t total = entries_.bucket_count() * sizeof(void*) + bits_.capacity() * sizeof(uint64_t);
    for (const auto& [node, e] : entries_)
      total += sizeof(std::pair<const int32_t, Entry>) + 2 * sizeof(void*) + e.top.capacity() * sizeof(Child);
    return total;
  }

 private:
  bool marked(int32_t node) const {
    const size_t word = static_cast<size_t>(node) >> 6;
    return word < bits_.size() && (bits_[word] >> (node & 63) & 1);
  }
  void mark(int32_t node, bool on) {
    const size_t word = static_cast<size_t>(node) >> 6;
    if (word >= bits_.size()) bits_.resize(word + 1, 0);
    const uint64_t bit = uint64_t{1} << (node & 63);
    bits_[word] = on ? bits_[word] | bit : bits_[word] & ~bit;
  }
  void drop(int32_t node) {
    if (!marked(node)) return;
    entries_.erase(node);
    mark(node, false);
  }

  size_t keep_;
  std::unordered_map<int32_t, Entry> entries_;
  std::vector<uint64_t> bits_;  // nodes with an entry: most lookups are of nodes without one
};

}  // namespace spectool
