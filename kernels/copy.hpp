// Byte-copy kernels between user tensors and windows. Plain memcpy is the right tool here:
// glibc picks the widest vector moves (and non-temporal stores for copies larger than the
// cache) at run time. Rings wrap, so the ring variants split a copy at the ring's end.
#pragma once

#include <cstdint>
#include <cstring>

namespace cam::kernels {

inline void copy_bytes(void* dst, const void* src, int64_t n) {
  if (n > 0) std::memcpy(dst, src, size_t(n));
}

// Write n bytes at stream position pos of a ring of ring_bytes.
inline void ring_write(char* ring, int64_t ring_bytes, uint64_t pos, const char* src, int64_t n) {
  const int64_t off = int64_t(pos % uint64_t(ring_bytes));
  const int64_t first = n < ring_bytes - off ? n : ring_bytes - off;
  copy_bytes(ring + off, src, first);
  copy_bytes(ring, src + first, n - first);
}

inline void ring_read(char* dst, const char* ring, int64_t ring_bytes, uint64_t pos, int64_t n) {
  const int64_t off = int64_t(pos % uint64_t(ring_bytes));
  const int64_t first = n < ring_bytes - off ? n : ring_bytes - off;
  copy_bytes(dst, ring + off, first);
  copy_bytes(dst + first, ring, n - first);
}

// Orders weakly-ordered (non-temporal) stores before a following signal_release.
inline void store_fence() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

}  // namespace cam::kernels
