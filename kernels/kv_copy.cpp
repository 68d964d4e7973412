#include "kv_copy.hpp"

#include <cstring>

namespace cam::kernels {

void kv_copy(const KVPoolSide& src, const KVPoolSide& dst, const KVRun* runs, int64_t nruns,
             const KVHeadPiece* pieces, int64_t npieces) {
  kv_copy_moves(src, dst, runs, nruns, pieces, npieces,
                [](char* d, const char* s, size_t n) { std::memcpy(d, s, n); });
}

}  // namespace cam::kernels
