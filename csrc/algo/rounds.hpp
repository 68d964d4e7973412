// Staged rounds: the collectives in which every rank contributes a same-sized buffer and
// readers combine what the others contributed, chunk by chunk.
//
//   all_reduce, one-shot   every rank stages its chunk; every rank reduces all N chunks
//   all_reduce, eager      one-shot for small inputs: the input is copied into the window's
//                          eager area before the descriptor is published, so after the
//                          descriptor exchange every rank reduces at once (no staging signals)
//   all_reduce, two-shot   reduce-scatter then all-gather: every rank stages N pieces (one per
//                          rank), reduces the piece it owns into a result area of its slot and
//                          publishes it (the `reduced` signal); every rank then copies all
//                          reduced pieces out
//   reduce                 every rank but the root stages; the root reduces
//   reduce_scatter         as the first half of two-shot; the reduced piece goes to the output
//   all_gather, gather     every rank stages its chunk; readers (all, or the root) copy them
//
// A round k moves bytes [k*c, (k+1)*c) of every piece. Rounds go through a ring of slots in
// each rank's staging region; a slot is restaged only after every reader has released it
// (`consumed`), so any size streams through the fixed window and consecutive rounds overlap
// (a rank stages round k+1 while its peers still reduce round k). A rank never stages what
// only it reads: its own piece is read straight from its input.
//
// Zero-copy: when every rank's input is a heap-resident tensor (torch_cam.empty), nothing is
// staged: readers take pieces straight out of the peers' tensors, two-shot reduces each piece
// into its owner's tensor and peers copy it from there, and a rank returns only after every
// reader has released its tensor (the user may overwrite it as soon as the op completes).
// One-shot and reduce keep staging: they write the output while peers would still read it.
//
// Reductions run in rank order 0..N-1 in every rank that reduces a given element, and a
// two-shot element is reduced once and copied, so every rank ends with identical bits.
#pragma once

#include "../../kernels/reduce.hpp"
#include "collective.hpp"

namespace cam {

enum class RoundsMode : int32_t {
  kAllReduceOneShot = 1,
  kAllReduceTwoShot,
  kReduce,
  kReduceScatter,
  kAllGather,
  kGather,
  kAllReduceEager,
};
const char* rounds_mode_name(RoundsMode m);

struct RoundsArgs {
  RoundsMode mode;
  at::Tensor input;   // contiguous: what this rank contributes
  at::Tensor output;  // contiguous: all_reduce/reduce: like input; reduce_scatter: 1/N of it;
                      // gathers: N times it; undefined where this rank receives nothing
  int root = 0;
  kernels::RedOp red_op = kernels::RedOp::kSum;
  // reduce_scatter: bytes of the block each rank receives (uneven lists); empty: N equal blocks.
  std::vector<int64_t> blocks;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (user tensor, output view)
  std::vector<at::Tensor> outputs;                           // the future's value
};

class RoundsOp final : public CollectiveOp {
 public:
  RoundsOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, RoundsArgs args);
  void finalize() override;
  int trace_peer() const override { return root_only() ? a_.root : -1; }

 protected:
  void fill_desc(Context& ctx, CollDesc* d) override;
  void validate(Context& ctx, const std::vector<const CollDesc*>& descs) override;
  bool data_step(Context& ctx) override;

 private:
  struct Piece {
    int64_t off, len;  // bytes within the input
  };
  bool root_only() const { return a_.mode == RoundsMode::kReduce || a_.mode == RoundsMode::kGather; }
  bool reduces() const {
    return a_.mode != RoundsMode::kAllGather && a_.mode != RoundsMode::kGather;
  }
  void plan(Context& ctx);
  Piece piece(int part, int64_t round) const;
  int64_t block_bytes(Context& ctx, int j) const;
  char* slot(Context& ctx, int rank, int64_t round) const;
  bool stage(Context& ctx);
  bool combine(Context& ctx);
  bool gather_reduced(Context& ctx);
  bool readers_released(Context& ctx);
  // Where rank p's bytes at input offset `off` of round k are: its tensor or its slot.
  const char* source(Context& ctx, int p, int64_t k, int64_t off, int64_t slot_off) const {
    if (p == ctx.rank) return in_ + off;
    return zero_copy_ ? heap_src_[p] + off : slot(ctx, p, k) + slot_off;
  }

  RoundsArgs a_;
  char* in_ = nullptr;
  char* out_ = nullptr;
  int64_t in_bytes_ = 0, elem_ = 1;
  // Geometry, fixed by plan(): parts per slot, piece bytes per round, slot ring.
  int parts_ = 1;
  bool result_area_ = false, stages_ = false, reads_ = false, zero_copy_ = false;
  std::vector<char*> heap_src_;  // zero-copy: where each rank's input is mapped here
  std::vector<int64_t> block_off_, block_len_;
  int64_t sub_ = 0, slot_bytes_ = 0, nslots_ = 0, nrounds_ = -1;
  int64_t staged_ = 0, combined_ = 0, gathered_ = 0;
  std::vector<const void*> srcs_;
};

}  // namespace cam
