// MoeGroup: MoE expert-parallel dispatch and combine of one cam group, a sibling of the
// backend's collectives over the group's runtime (OpIssuer, Engine). The Python layer
// (torch_cam/moe.py, moe_buffer.py) translates torch_npu's, CAM's and DeepEP's arguments into
// these two ops and checks them (refusing through OpIssuer::refuse); here everything the C++
// side reads is checked again (device, contiguity, dtypes, shapes, segment bounds), and a
// failure is a refusal too.
#pragma once

#include <memory>
#include <mutex>

#include "../core/recycling_pool.hpp"
#include "../runtime/op_issuer.hpp"
#include "moe_ops.hpp"

namespace cam {

class MoeGroup {
 public:
  MoeGroup(std::shared_ptr<OpIssuer> issuer, int rank, int size, int64_t output_cache_bytes);

  c10::intrusive_ptr<c10d::Work> dispatch(MoeDispatchArgs args, std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> combine(MoeCombineArgs args, std::chrono::milliseconds timeout);
  // Bytes of the stage (0 before the first op).
  int64_t stage_bytes() const;
  // A tensor for an op's output from the group's recycling pool (see recycling_pool.hpp).
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) { return output_pool_->empty(sizes, dtype); }
  int64_t output_cache_bytes() const { return output_pool_->cached_bytes(); }

 private:
  MoeStage& stage();
  template <typename MoeOpT, typename Args>
  c10::intrusive_ptr<c10d::Work> issue(Args a, std::chrono::milliseconds timeout);

  std::shared_ptr<OpIssuer> issuer_;
  int rank_, size_;
  std::shared_ptr<RecyclingPool> output_pool_;
  mutable std::mutex stage_mu_;
  std::unique_ptr<MoeStage> stage_;  // created by the first op
};

}  // namespace cam
