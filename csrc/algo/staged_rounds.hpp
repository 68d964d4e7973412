// Staged rounds: the engine of the collectives in which every rank contributes a same-sized
// buffer and readers combine what the others contributed, chunk by chunk. Each collective is
// a subclass in its own file and states only what differs: its shape (who stages, who reads,
// whether an input splits into one piece per rank) and what a reader does with a round.
//
//   all_reduce (all_reduce.cpp)
//     one-shot           every rank stages its chunk; every rank reduces all N chunks
//     eager              one-shot for small inputs (see Eager below)
//     two-shot           reduce-scatter then all-gather: every rank stages N pieces (one per
//                        rank), reduces the piece it owns into a result area of its slot and
//                        publishes it (the `reduced` signal); every rank then copies all
//                        reduced pieces out
//   reduce (reduce.cpp)  every rank but the root stages; the root reduces
//   reduce_scatter (reduce_scatter.cpp)  as the first half of two-shot; the reduced piece goes
//                        to the output
//   all_gather, gather (all_gather.cpp)  every rank stages its chunk; readers (all, or the
//                        root) copy them
//
// A round k moves bytes [k*c, (k+1)*c) of every piece. Rounds go through a ring of slots in
// each rank's staging region; a slot is restaged only after every reader has released it
// (`consumed`), so any size streams through the fixed window and consecutive rounds overlap
// (a rank stages round k+1 while its peers still read round k). A rank never stages what
// only it reads: its own piece is read straight from its input.
//
// Eager: an input that fits the window's eager area (CollectiveWindow::eager_fits) is copied
// there before the descriptor is published and read from there in one round once every
// descriptor is visible: no staging signals, no release, so a small collective costs one
// synchronisation. all_reduce goes eager as its own algorithm (eager one-shot, chosen by
// eager_max_bytes); the other shapes whenever the input fits. It takes precedence over
// zero-copy, whose release is a second synchronisation.
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

#include <memory>

#include "../../kernels/reduce.hpp"
#include "collective.hpp"

namespace cam {

// Which staged algorithm a rank runs, published in its descriptor (all ranks must agree; 0 is
// the all-to-all path of an uneven all_gather).
enum class StagedAlgo : int32_t {
  kAllReduceOneShot = 1,
  kAllReduceTwoShot,
  kReduce,
  kReduceScatter,
  kAllGather,
  kGather,
  kAllReduceEager,
};
const char* staged_algo_name(StagedAlgo a);

struct StagedRoundsArgs {
  StagedAlgo algo;
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

// The op of args.algo; each collective's file defines its own.
std::shared_ptr<CollectiveOp> make_staged_rounds_op(const char* name, CollKind kind, uint64_t seq,
                                                    Clock::time_point deadline, StagedRoundsArgs args);
std::shared_ptr<CollectiveOp> make_all_reduce_op(const char* name, CollKind kind, uint64_t seq,
                                                 Clock::time_point deadline, StagedRoundsArgs args);
std::shared_ptr<CollectiveOp> make_reduce_op(const char* name, CollKind kind, uint64_t seq,
                                             Clock::time_point deadline, StagedRoundsArgs args);
std::shared_ptr<CollectiveOp> make_reduce_scatter_op(const char* name, CollKind kind, uint64_t seq,
                                                     Clock::time_point deadline, StagedRoundsArgs args);
std::shared_ptr<CollectiveOp> make_all_gather_op(const char* name, CollKind kind, uint64_t seq,
                                                 Clock::time_point deadline, StagedRoundsArgs args);

class StagedRoundsOp : public CollectiveOp {
 public:
  // What a collective states about itself.
  struct Shape {
    bool root_only = false;      // only the root reads, and nobody reads the root's input
    bool reduces = false;
    bool split = false;          // an input is N pieces, piece j read (and owned) by rank j
    bool result_area = false;    // a slot also holds the reduced piece of its stager (two-shot)
    bool eager = false;          // inputs that fit go through the eager area
    bool reads_in_place = true;  // zero-copy when every input is heap-resident
  };
  // `args` is taken by reference so that a subclass can derive `shape` from it in the same call.
  StagedRoundsOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, Shape shape,
                 StagedRoundsArgs&& args);
  void finalize() override;
  int trace_peer() const override { return shape_.root_only ? args_.root : -1; }

 protected:
  struct Piece {
    int64_t off, len;  // bytes within the input
  };

  // Subclasses add to the descriptor and to its checks: which path each rank took (first),
  // how each rank splits its input (last).
  virtual void fill_desc_extra(Context&, CollDesc*) {}
  virtual void validate_path(Context&, const std::vector<const CollDesc*>&) {}
  virtual void validate_blocks(Context&, const std::vector<const CollDesc*>&) {}
  // Block j of the input (its offset and bytes), for split shapes; default: all of it.
  virtual void split_blocks(Context& ctx);
  // Round k's action once every piece it needs is readable (see source()).
  virtual void read_round(Context& ctx, int64_t k) = 0;
  // After this rank's reads: a second phase (two-shot's gather of the reduced pieces, counted
  // in gathered_); returns whether anything moved.
  virtual bool after_reads(Context&) { return false; }

  Piece piece(int part, int64_t round) const;
  // Reduces round k of every rank's whole input into the output (one-shot, reduce).
  void reduce_whole_round(Context& ctx, int64_t k);
  char* slot(Context& ctx, int rank, int64_t round) const;
  // Where rank p's bytes at input offset `off` of round k are: its tensor or its slot.
  const char* source(Context& ctx, int p, int64_t k, int64_t off, int64_t slot_off) const {
    if (p == ctx.rank) return in_ + off;
    if (eager_) return ctx.coll.eager(ctx.peer(p), seq()) + off;
    return zero_copy_ ? heap_src_[p] + off : slot(ctx, p, k) + slot_off;
  }

  const Shape shape_;
  StagedRoundsArgs args_;
  char* in_ = nullptr;
  char* out_ = nullptr;
  int64_t in_bytes_ = 0, elem_ = 1;
  bool eager_ = false;  // this op's inputs go through the eager area (fill_desc decides)
  bool zero_copy_ = false;
  std::vector<char*> heap_src_;  // zero-copy: where each rank's input is mapped here
  std::vector<int64_t> block_off_, block_len_;
  // Geometry, fixed by plan(): pieces per slot, bytes of a piece per round, the slot ring.
  int pieces_ = 1;
  int64_t piece_bytes_ = 0, slot_bytes_ = 0, nslots_ = 0, nrounds_ = -1;
  int64_t staged_ = 0, read_ = 0, gathered_ = 0;
  std::vector<const void*> srcs_;

 private:
  void fill_desc(Context& ctx, CollDesc* d) final;
  void validate(Context& ctx, const std::vector<const CollDesc*>& descs) final;
  bool data_step(Context& ctx) final;
  void plan(Context& ctx);
  bool stage_rounds(Context& ctx);
  bool read_rounds(Context& ctx);
  bool readers_released(Context& ctx);
  bool stages_ = false, reads_ = false;
};

}  // namespace cam
