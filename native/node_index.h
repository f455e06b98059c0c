// The trie's index from (parent node, token) to the child node, 8 bytes a slot.
//
// Open addressing with linear probing and backward-shift deletion, like FlatMap, but a
// slot holds only the node id and 32 bits of the key's hash, not the key: the hash picks
// the home slot and filters the probe, and a candidate is confirmed against the node
// itself (its parent and token), which the trie reads anyway. Half the bytes of a
// (key, value) slot: twice the slots in each cache line a probe loads, and half the
// index's memory. The stored hash also gives every entry's home slot, so neither
// deletion nor growth reads a node.
#pragma once

#include <cstdint>
#include <vector>

#include "flat_map.h"
#include "huge_pages.h"

namespace spectool {

class NodeIndex {
 public:
  static uint32_t hash(int32_t parent, int32_t token) {
    uint64_t k = FlatMap::key(parent, token);
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return static_cast<uint32_t>(k);
  }

  // Returns the id stored under hash h for which is_key(id) holds, or -1.
  template <class IsKey>
  int32_t find(uint32_t h, IsKey&& is_key) const {
    if (slots_.empty()) return -1;
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot s = slots_[i];
      if (s.id < 0) return -1;
      if (s.hash == h && is_key(s.id)) return s.id;
    }
  }

  // Starts loading the slot where a lookup of h begins.
  void prefetch(uint32_t h) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[h & mask_]);
  }

  // Adds node id under hash h; its key must not be in the index.
  void insert(uint32_t h, int32_t id) {
    if ((size_ + 1) * 10 > slots_.size() * 7) grow();
    size_t i = h & mask_;
    while (slots_[i].id >= 0) i = (i + 1) & mask_;
    slots_[i] = Slot{h, id};
    ++size_;
  }

  // Removes node id, stored under hash h (a no-op if it is not there).
  void erase(uint32_t h, int32_t id) {
    if (slots_.empty()) return;
    size_t i = h & mask_;
    while (slots_[i].id != id) {
      if (slots_[i].id < 0) return;
      i = (i + 1) & mask_;
    }
    // Backward shift: pull later entries of the probe run into the hole when their home
    // slot allows it, so every remaining entry stays reachable from its home slot.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; slots_[j].id >= 0; j = (j + 1) & mask_) {
      if (fills_hole(hole, j, slots_[j].hash & mask_)) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
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
  struct Slot {
    uint32_t hash = 0;
    int32_t id = -1;  // -1: empty
  };
  static_assert(sizeof(Slot) == 8, "eight slots per cache line");

  void grow() {
    std::vector<Slot> old;
    old.swap(slots_);
    const size_t n = old.empty() ? 1024 : old.size() * 2;  // hashes are 32-bit: at most 2^32 slots
    slots_.reserve(n);
    advise_huge_pages(slots_.data(), n * sizeof(Slot));  // before the fill touches the pages
    slots_.assign(n, Slot{});
    mask_ = n - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.id >= 0) insert(s.hash, s.id);
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace spectool
