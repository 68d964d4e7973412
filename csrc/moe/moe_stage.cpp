#include "moe_stage.hpp"

namespace cam {

char* MoeStage::reserve(uint64_t seq, int64_t bytes) {
  at::Tensor& h = half_[seq & 1];
  bytes = std::max<int64_t>(stage_align(bytes), kStageAlign);
  if (!h.defined() || int64_t(h.nbytes()) < bytes) {
    const int64_t old = h.defined() ? int64_t(h.nbytes()) : 0;
    h = at::Tensor();  // free first so the arena can reuse the space
    // Grow with headroom so a slowly rising load does not reallocate on every call.
    const int64_t want = std::max(bytes, old + old / 2);
    h = arena_->empty({want}, at::kByte);
    bytes_.fetch_add(want - old, std::memory_order_relaxed);
  }
  return static_cast<char*>(h.data_ptr());
}

}  // namespace cam
