// The trie's index from (parent node, token) to the child node, 8 bytes a slot.
//
// Open addressing with linear probing and backward-shift deletion (probe_table.h), like FlatMap, but a
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
#include "probe_table.h"

namespace spectool {

namespace node_index_detail {
struct Slot {
  uint32_t hash = 0;
  int32_t id = -1;  // -1: empty
};
static_assert(sizeof(Slot) == 8, "eight slots per cache line");
}  // namespace node_index_detail

class NodeIndex : public ProbeTable<node_index_detail::Slot> {
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
    if (full_for_one_more()) grow();
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
    erase_at(i, [](const Slot& s) { return s.id < 0; }, [this](const Slot& s) { return s.hash & mask_; });
  }

 private:
  using Slot = node_index_detail::Slot;

  void grow() {  // hashes are 32-bit: at most 2^32 slots
    for (const Slot& s : reallocate())
      if (s.id >= 0) insert(s.hash, s.id);
  }
};

}  // namespace spectool
