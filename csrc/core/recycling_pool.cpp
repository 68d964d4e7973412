#include "recycling_pool.hpp"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace cam {

namespace {
// Sizes are rounded up to this, so that calls whose outputs differ by a few rows share blocks.
constexpr int64_t kGranule = 64 << 10;
}  // namespace

RecyclingPool::~RecyclingPool() {
  for (auto& [n, p] : free_) std::free(p);
}

int64_t RecyclingPool::cached_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cached_;
}

at::Tensor RecyclingPool::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t want = std::max<int64_t>(numel * int64_t(c10::elementSize(dtype)), 1);
  const int64_t n = (want + kGranule - 1) / kGranule * kGranule;
  void* p = nullptr;
  int64_t got = n;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Best fit, but never a block more than twice the size (it would pin memory for nothing).
    auto it = free_.lower_bound(n);
    if (it != free_.end() && it->first <= 2 * n) {
      got = it->first;
      p = it->second;
      cached_ -= got;
      free_.erase(it);
    }
  }
  if (p == nullptr) {
    TORCH_CHECK(posix_memalign(&p, 64, size_t(n)) == 0, "cam: out of memory allocating ", n,
                " bytes");
  }
  auto self = shared_from_this();
  return at::from_blob(
      p, sizes, [self, got](void* q) { self->give_back(q, got); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void RecyclingPool::give_back(void* p, int64_t n) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (cached_ + n <= cap_) {
      free_.emplace(n, p);
      cached_ += n;
      return;
    }
  }
  std::free(p);
}

}  // namespace cam
