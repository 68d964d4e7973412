// RecyclingPool: recycled memory for large tensors an op allocates every call (the outputs of
// MoE ops: expand_x, combined tokens; the scratch of the compositions of groups across hosts).
//
// A dispatch at decode sizes writes tens of MiB into a freshly allocated expand_x; large
// allocations come straight from mmap, so every call would first-touch (page-fault) all of it,
// which on a VM costs more than the copy itself (64 MiB: 44 ms fresh, 3.5 ms reused here). Tensors from this pool are ordinary CPU
// tensors whose storage returns here when the caller drops them, and the next op of a similar
// size reuses it: no per-call faults, and nothing is ever reused while a tensor still holds it.
// Blocks are kept up to `cap_bytes` in total (beyond that they are freed); stats() reports the
// cached bytes.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>

namespace cam {

class RecyclingPool : public std::enable_shared_from_this<RecyclingPool> {
 public:
  explicit RecyclingPool(int64_t cap_bytes) : cap_(cap_bytes) {}
  ~RecyclingPool();
  RecyclingPool(const RecyclingPool&) = delete;
  RecyclingPool& operator=(const RecyclingPool&) = delete;

  // A contiguous CPU tensor; contents are whatever the block held (like torch.empty).
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  int64_t cached_bytes() const;

 private:
  void give_back(void* p, int64_t n);
  int64_t cap_;
  mutable std::mutex mu_;
  std::multimap<int64_t, void*> free_;  // block size -> block
  int64_t cached_ = 0;
};

}  // namespace cam
