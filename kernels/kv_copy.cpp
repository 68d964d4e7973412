#include "kv_copy.hpp"

#include <cstring>

namespace cam::kernels {

namespace {
// Both sides NHD and the piece spans every head of both: a run is one contiguous range on each
// side, and consecutive runs that continue both ranges merge into one memcpy.
void copy_whole_runs(const KVPoolSide& src, const KVPoolSide& dst, const KVRun* runs, int64_t nruns) {
  const int64_t token_bytes = src.heads * src.head_bytes;
  for (int64_t c = 0; c < src.planes; ++c) {
    int64_t r = 0;
    while (r < nruns) {
      char* s = src.base + src.offset(c, runs[r].src_block, runs[r].src_slot, 0);
      char* d = dst.base + dst.offset(c, runs[r].dst_block, runs[r].dst_slot, 0);
      int64_t bytes = runs[r].tokens * token_bytes;
      for (++r; r < nruns; ++r) {
        if (src.base + src.offset(c, runs[r].src_block, runs[r].src_slot, 0) != s + bytes ||
            dst.base + dst.offset(c, runs[r].dst_block, runs[r].dst_slot, 0) != d + bytes) {
          break;
        }
        bytes += runs[r].tokens * token_bytes;
      }
      std::memcpy(d, s, size_t(bytes));
    }
  }
}
}  // namespace

void kv_copy(const KVPoolSide& src, const KVPoolSide& dst, const KVRun* runs, int64_t nruns,
             const KVHeadPiece* pieces, int64_t npieces) {
  const int64_t hb = src.head_bytes;
  if (npieces == 1 && !src.hnd && !dst.hnd && pieces[0].heads == src.heads && pieces[0].heads == dst.heads) {
    copy_whole_runs(src, dst, runs, nruns);
    return;
  }
  for (int64_t c = 0; c < src.planes; ++c) {
    for (int64_t r = 0; r < nruns; ++r) {
      const KVRun& run = runs[r];
      for (int64_t p = 0; p < npieces; ++p) {
        const KVHeadPiece& pc = pieces[p];
        auto at_src = [&](int64_t t, int64_t h) {
          return src.base + src.offset(c, run.src_block, run.src_slot + t, pc.src_head + h);
        };
        auto at_dst = [&](int64_t t, int64_t h) {
          return dst.base + dst.offset(c, run.dst_block, run.dst_slot + t, pc.dst_head + h);
        };
        if (!src.hnd && !dst.hnd && pc.heads == src.heads && pc.heads == dst.heads) {
          std::memcpy(at_dst(0, 0), at_src(0, 0), size_t(run.tokens * pc.heads * hb));  // whole run
        } else if (!src.hnd && !dst.hnd) {
          for (int64_t t = 0; t < run.tokens; ++t) {
            std::memcpy(at_dst(t, 0), at_src(t, 0), size_t(pc.heads * hb));  // a token's heads
          }
        } else if (src.hnd && dst.hnd) {
          for (int64_t h = 0; h < pc.heads; ++h) {
            std::memcpy(at_dst(0, h), at_src(0, h), size_t(run.tokens * hb));  // a head's tokens
          }
        } else {
          for (int64_t t = 0; t < run.tokens; ++t) {
            for (int64_t h = 0; h < pc.heads; ++h) std::memcpy(at_dst(t, h), at_src(t, h), size_t(hb));
          }
        }
      }
    }
  }
}

}  // namespace cam::kernels
