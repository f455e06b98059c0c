// Open-addressing hash map from a (parent id, token) pair to a node id.
//
// The suffix automaton looks up one transition per step of every walk, so the lookup
// must be a few loads, not a node-based std::unordered_map (the trie has its own,
// smaller index: node_index.h). Linear probing with
// backward-shift deletion keeps the table free of tombstones under LRU eviction.
#pragma once

#include <cstdint>
#include <vector>

#include "huge_pages.h"

namespace spectool {

// Backward-shift deletion, shared by FlatMap and NodeIndex: may the entry at slot j, whose home
// slot is `home`, move into the hole at slot `hole` (earlier in j's probe run, wrapping)?
inline bool fills_hole(size_t hole, size_t j, size_t home) {
  return hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
}

class FlatMap {
 public:
  static uint64_t key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  }

  // Returns the value stored under k, or -1.
  int32_t find(uint64_t k) const {
    if (slots_.empty()) return -1;
    for (size_t i = slot_of(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == k) return s.value;
      if (s.key == kEmpty) return -1;
    }
  }

  // Starts loading the slot where a lookup of k begins.
  void prefetch(uint64_t k) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[slot_of(k)]);
  }

  // Inserts or overwrites.
  void put(uint64_t k, int32_t value) {
    if ((size_ + 1) * 10 > slots_.size() * 7) grow();
    for (size_t i = slot_of(k);; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.key == k) {
        s.value = value;
        return;
      }
      if (s.key == kEmpty) {
        s.key = k;
        s.value = value;
        ++size_;
        return;
      }
    }
  }

  void erase(uint64_t k) {
    if (slots_.empty()) return;
    size_t i = slot_of(k);
    while (slots_[i].key != k) {
      if (slots_[i].key == kEmpty) return;
      i = (i + 1) & mask_;
    }
    // Backward shift: pull later entries of the probe run into the hole when their home
    // slot allows it, so every remaining key stays reachable from its home slot.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; slots_[j].key != kEmpty; j = (j + 1) & mask_) {
      if (fills_hole(hole, j, slot_of(slots_[j].key))) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].key = kEmpty;
    --size_;
  }

  void clear() {
    slots_.clear();
    slots_.shrink_to_fit();
    size_ = 0;
    mask_ = 0;
  }

  size_t size() const { return size_; }
  size_t bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Slot {
    uint64_t key = kEmpty;
    int32_t value = -1;
  };

  size_t slot_of(uint64_t k) const {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask_;
  }

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    size_t n = old.empty() ? 1024 : old.size() * 2;
    slots_.reserve(n);
    advise_huge_pages(slots_.data(), n * sizeof(Slot));  // before the fill touches the pages
    slots_.assign(n, Slot{});
    mask_ = n - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != kEmpty) put(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace spectool
