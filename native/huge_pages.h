// Asks the kernel to back a large array with 2 MiB pages.
//
// The trie's node, index and LRU-queue arrays are hundreds of MB each and every lookup
// lands on a random page, so with 4 KiB pages nearly every access is also a TLB miss.
// Transparent huge pages are commonly set to "madvise" (only regions that ask get them),
// so the arrays ask. Only whole 2 MiB pages inside the array are advised; the call is
// a hint, and a kernel without THP simply ignores it.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace spectool {

inline void advise_huge_pages(const void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace spectool
