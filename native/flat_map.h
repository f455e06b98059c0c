// Open-addressing hash map from a (parent id, token) pair to a node id.
//
// The suffix automaton looks up one transition per step of every walk, so the lookup
// must be a few loads, not a node-based std::unordered_map (the trie has its own,
// smaller index: node_index.h). Linear probing with backward-shift deletion (probe_table.h).
#pragma once

#include <cstdint>
#include <vector>

#include "probe_table.h"

namespace spectool {

namespace flat_map_detail {
constexpr uint64_t kEmpty = ~uint64_t{0};
struct Slot {
  uint64_t key = kEmpty;
  int32_t value = -1;
};
}  // namespace flat_map_detail

class FlatMap : public ProbeTable<flat_map_detail::Slot> {
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
    if (full_for_one_more()) grow();
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
    erase_at(i, [](const Slot& s) { return s.key == kEmpty; },
             [this](const Slot& s) { return slot_of(s.key); });
  }

 private:
  using Slot = flat_map_detail::Slot;
  static constexpr uint64_t kEmpty = flat_map_detail::kEmpty;

  size_t slot_of(uint64_t k) const {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask_;
  }

  void grow() {
    for (const Slot& s : reallocate())
      if (s.key != kEmpty) put(s.key, s.value);
  }
};

}  // namespace spectool
