// MoeStage: where a rank publishes what MoE dispatch and combine let peers pull.
//
// Two halves in the rank's tensor arena, chosen by the collective's parity: an op with
// sequence number n writes half n & 1 before publishing its descriptor. That is safe without a
// barrier because the last readers of that half ran op n - 2, and this rank finished op n - 1
// only after seeing every peer's descriptor of n - 1, which each peer publishes after it
// finished op n - 2. So consecutive layers' dispatches and combines need no extra
// synchronisation beyond the descriptor exchange each op already does.
//
// A half grows (reallocated, never shrunk) to the largest size a call needed; its bytes are
// reported by stats() ("moe_stage_bytes"). Peers locate a half by its arena offset, which
// every op publishes in its descriptor.
//
// The halves are never released when the stage dies: the group's last MoE op has no successor
// to prove that every peer has finished reading, and releasing punches the pages out (peers
// would read zeros). They go with the window's mapping instead, which peers keep until they
// unmap it themselves.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>

#include "../transport/tensor_arena.hpp"

namespace cam {

class MoeStage {
 public:
  explicit MoeStage(TensorArena* arena) : arena_(arena) {}
  // At least `bytes` of half seq & 1. Called only by the thread that runs the group's
  // collectives (one at a time, in issue order).
  char* reserve(uint64_t seq, int64_t bytes);
  int64_t arena_offset(uint64_t seq) const { return off_[seq & 1]; }
  int64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }

 private:
  TensorArena* arena_;
  int64_t off_[2] = {-1, -1};
  int64_t len_[2] = {0, 0};
  std::atomic<int64_t> bytes_{0};
};

// Alignment of every array placed in a stage half.
constexpr int64_t kStageAlign = 64;
inline int64_t stage_align(int64_t n) { return (n + kStageAlign - 1) / kStageAlign * kStageAlign; }

}  // namespace cam
