#include "moe_stage.hpp"

namespace cam {

char* MoeStage::reserve(uint64_t seq, int64_t bytes) {
  const int h = int(seq & 1);
  bytes = std::max<int64_t>(stage_align(bytes), kStageAlign);
  if (len_[h] < bytes) {
    // The old half's last readers ran op seq - 2, which every peer has finished (see above),
    // so its pages may go back before the new half is reserved. Grow with headroom so that a
    // slowly rising load does not reallocate on every call.
    const int64_t want = std::max(bytes, len_[h] + len_[h] / 2);
    if (off_[h] >= 0) {
      arena_->release_block(off_[h]);
      bytes_.fetch_sub(len_[h], std::memory_order_relaxed);
      off_[h] = -1;
      len_[h] = 0;
    }
    off_[h] = arena_->reserve_block(want);
    len_[h] = want;
    bytes_.fetch_add(want, std::memory_order_relaxed);
  }
  return arena_->block(off_[h]);
}

}  // namespace cam
