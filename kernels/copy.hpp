// Byte-copy kernels between user tensors and windows. memcpy is the right tool here: glibc
// picks the widest vector moves at run time. Large copies go in kCopyPieceBytes calls: glibc
// chooses its large-copy strategy from the cache sizes the CPU reports, and where those are
// wrong (a VM that reports a 384 MiB shared cache) a single call of several MiB ran 1.2-1.7x
// slower than the same bytes in 256 KiB calls, warm or cold (benchmarks/results_copy.md).
// Rings wrap, so the ring variants split a copy at the ring's end.
#pragma once

#include <cstdint>
#include <cstring>

namespace cam::kernels {

constexpr int64_t kCopyPieceBytes = 256 << 10;

inline void copy_bytes(void* dst, const void* src, int64_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  for (; n > kCopyPieceBytes; n -= kCopyPieceBytes, d += kCopyPieceBytes, s += kCopyPieceBytes) {
    std::memcpy(d, s, size_t(kCopyPieceBytes));
  }
  if (n > 0) std::memcpy(d, s, size_t(n));
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
