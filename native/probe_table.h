// Storage shared by the two linear-probing tables (FlatMap, NodeIndex): a power-of-two
// slot array on huge pages, grown at 70 % load, and backward-shift deletion, which keeps
// the table free of tombstones under LRU eviction. Each table keeps its own lookup and
// insert (what a slot holds and how a key is matched differ).
#pragma once

#include <cstdint>
#include <vector>

#include "huge_pages.h"

namespace spectool {

// May the entry at slot j, whose home slot is `home`, move into the hole at slot `hole`
// (earlier in j's probe run, wrapping)?
inline bool fills_hole(size_t hole, size_t j, size_t home) {
  return hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
}

template <class Slot>
class ProbeTable {
 public:
  void clear() {
    slots_.clear();
    slots_.shrink_to_fit();
    size_ = 0;
    mask_ = 0;
  }

  size_t size() const { return size_; }
  size_t bytes() const { return slots_.capacity() * sizeof(Slot); }

 protected:
  bool full_for_one_more() const { return (size_ + 1) * 10 > slots_.size() * 7; }

  // Swaps in twice the slots (1024 at first), all empty; returns the old ones to re-insert.
  std::vector<Slot> reallocate() {
    std::vector<Slot> old;
    old.swap(slots_);
    const size_t n = old.empty() ? 1024 : old.size() * 2;
    slots_.reserve(n);
    advise_huge_pages(slots_.data(), n * sizeof(Slot));  // before the fill touches the pages
    slots_.assign(n, Slot{});
    mask_ = n - 1;
    size_ = 0;
    return old;
  }

  // Empties the occupied slot i. Backward shift: later entries of its probe run move into the
  // hole when their home slot allows it, so every remaining entry stays reachable from home.
  template <class IsEmpty, class HomeOf>
  void erase_at(size_t i, IsEmpty&& is_empty, HomeOf&& home_of) {
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; !is_empty(slots_[j]); j = (j + 1) & mask_) {
      if (fills_hole(hole, j, home_of(slots_[j]))) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace spectool
