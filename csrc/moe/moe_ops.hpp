// MoE expert-parallel dispatch and combine as collectives of a cam group.
//
// Both are pull-based and take one synchronisation each: a rank writes everything its peers
// will read into its MoeStage half (the "counts phase" is part of it: the routing in CSR form,
// experts x entries) and only then publishes its collective descriptor; once it has seen every
// peer's descriptor it validates all headers (so bad input anywhere fails on every rank, before
// any row moves) and copies the rows it receives straight from the peers' stages to their final
// place in its outputs, quantizing or weighting inside that copy.
//
//   dispatch  sender stages its token rows once (not once per expert), its routing and
//             weights; receiver d walks (local expert j, source rank, source token order) and
//             pulls each routed row to its position (compact, or per-expert slabs), int8
//             quantization with per-expert smooth scales fused into the pull
//   combine   each rank stages the rows it computed for other ranks' tokens (optionally
//             int8-quantized for transport) and a table of segments; a token owner pulls the
//             rows its plan names (peer, segment, offset, weight) - its own straight from its
//             tensor - accumulates w * row in fp32 and rounds once
//
// Rows a rank passes that already live in its tensor heap (torch_cam.empty) are read in place
// instead of being staged; such a rank then waits until every peer has finished reading them.
#pragma once

#include <cstring>

#include "../algo/collective.hpp"
#include "moe_stage.hpp"

namespace cam {

// What both ops share: the stage, per-peer wait times, and the release protocol of rows read
// in place. (A rank's bad input never reaches these ops: it is refused before, see RefusedOp.)
class MoeOp : public CollectiveOp {
 public:
  MoeOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, MoeStage* stage,
        bool record_waits)
      : CollectiveOp(name, kind, seq, deadline), stage_(stage) {
    record_arrivals_ = record_waits;
  }

 protected:
  // Reserves `bytes` of this op's stage half, zeroes the header at its start and points the
  // descriptor at it (peers find the stage through heap_off).
  template <typename Header>
  Header* stage_header(CollDesc* d, int64_t bytes) {
    auto* h = reinterpret_cast<Header*>(stage_->reserve(seq(), bytes));
    std::memset(static_cast<void*>(h), 0, sizeof(Header));
    d->heap_off = stage_->arena_offset(seq());
    return h;
  }
  // Adds each peer's wait (see CollectiveOp::arrival_us_) to `wait_us`, if defined.
  void add_wait_times(const at::Tensor& wait_us) const;
  // After pulling: tell every peer; a rank whose rows were read in place is done only once
  // every peer has said so (the caller may overwrite them as soon as the op completes).
  bool release_and_wait(Context& ctx);
  MoeStage* stage_;
  bool in_place_ = false;
  bool pulled_ = false;

 private:
  bool released_ = false;
  int next_reader_ = 0;
};

struct MoeDispatchArgs {
  at::Tensor rows;            // (T, width) contiguous: the token rows (x, or its raw bytes)
  at::Tensor ids;             // (T, K) int32 contiguous: routed ids, -1 = not sent
  at::Tensor weights;         // (T, K) float32, or undefined
  at::Tensor aux;             // (T, aux_bytes) uint8, or undefined: copied with every row
  at::Tensor token_active;    // (T,) bool: tokens that go to shared-expert ranks
  at::Tensor smooth;          // (n, H) float32 smooth scales (quant), or undefined
  int64_t smooth_shift = 0;   // smooth row of routed expert e is e + shift (shared: row 0)
  int64_t num_experts = 0;    // routed id space M
  int32_t shared_ranks = 0;   // S: ranks 0..S-1 host the shared expert
  int32_t experts_per_rank = 1;
  bool quant = false;         // dynamic per-row int8
  int64_t slab_rows = 0;      // > 0: local expert j's rows start at j * slab_rows
  int64_t max_tokens = 0;     // > 0: every rank's T is at most this; 0: all ranks' T equal; < 0: free
  // Outputs (capacity rows each).
  at::Tensor out_rows;        // (cap, width) rows dtype, or (cap, H) int8 when quant
  at::Tensor out_scales;      // (cap,) float32 when quant
  at::Tensor out_weights;     // (cap,) float32 or undefined (routing weight of each row)
  at::Tensor out_info;        // (cap * info_stride,) int32 or undefined: [src, token, k]
  int64_t info_stride = 3;
  at::Tensor out_aux;         // (cap, aux_bytes) uint8 or undefined
  at::Tensor out_counts;      // (W * local experts,) int32: inclusive running sums
  at::Tensor out_occurrence;  // (T * K,) int32 or undefined: per routed entry, how many earlier
                              // entries of this rank chose the same expert (-1: not routed)
  at::Tensor wait_us;         // (W,) int64 or undefined: per-peer wait (us) added on success
};

class MoeDispatchOp final : public MoeOp {
 public:
  static constexpr const char* kTitle = "cam:moe_dispatch";
  MoeDispatchOp(uint64_t seq, Clock::time_point deadline, MoeStage* stage, MoeDispatchArgs args);

 protected:
  void fill_desc(Context& ctx, CollDesc* d) override;
  void validate(Context& ctx, const std::vector<const CollDesc*>& descs) override;
  bool data_step(Context& ctx) override;

 private:
  MoeDispatchArgs a_;
  std::vector<const struct MoeDispatchHeader*> peers_;
};

struct MoeCombineArgs {
  at::Tensor rows;            // (n, H) float32/bf16/fp16 contiguous: the rows this rank serves
  at::Tensor segments;        // (nseg, 3) int64: [first row, rows, source rank] of each segment
                              // of `rows` (the source rank is the token owner that reads them)
  bool quant = false;         // stage rows as int8 + scale (transport quantization)
  at::Tensor plan_peer;       // (T, P) int32: rank holding the row, -1 = none
  at::Tensor plan_seg;        // (T, P) int32: segment at that rank
  at::Tensor plan_off;        // (T, P) int64: row within the segment
  at::Tensor plan_weight;     // (T, P) float32, or undefined (weight 1)
  at::Tensor add;             // (T, H) float32 or out dtype, or undefined: added unweighted
  bool add_first = false;     // add before the pulled rows (else after them)
  at::Tensor out;             // (T, H) float32/bf16/fp16
  at::Tensor wait_us;         // (W,) int64 or undefined: per-peer wait (us) added on success
};

class MoeCombineOp final : public MoeOp {
 public:
  static constexpr const char* kTitle = "cam:moe_combine";
  MoeCombineOp(uint64_t seq, Clock::time_point deadline, MoeStage* stage, MoeCombineArgs args);

 protected:
  void fill_desc(Context& ctx, CollDesc* d) override;
  void validate(Context& ctx, const std::vector<const CollDesc*>& descs) override;
  bool data_step(Context& ctx) override;

 private:
  MoeCombineArgs a_;
  std::vector<const struct MoeCombineHeader*> peers_;
};

}  // namespace cam
