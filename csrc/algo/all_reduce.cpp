// all_reduce as staged rounds (staged_rounds.hpp): one-shot, eager and two-shot.
#include <algorithm>

#include "../../kernels/copy.hpp"
#include "staged_rounds.hpp"

namespace cam {
namespace {

class AllReduceOp final : public StagedRoundsOp {
 public:
  AllReduceOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, StagedRoundsArgs&& args)
      : StagedRoundsOp(name, kind, seq, deadline, shape_of(args.algo), std::move(args)) {}

 private:
  static Shape shape_of(StagedAlgo algo) {
    Shape s;
    s.reduces = true;
    switch (algo) {
      case StagedAlgo::kAllReduceTwoShot:
        s.split = true;
        s.result_area = true;
        break;
      case StagedAlgo::kAllReduceEager:
        s.eager = true;
        s.reads_in_place = false;
        break;
      default:  // one-shot writes the output while peers would still read the input
        s.reads_in_place = false;
        break;
    }
    return s;
  }
  bool two_shot() const { return args_.algo == StagedAlgo::kAllReduceTwoShot; }

  void split_blocks(Context& ctx) override {
    if (!two_shot()) return;
    // Split by elements; the last blocks may be shorter (or empty).
    const int n = ctx.world;
    const int64_t numel = in_bytes_ / elem_, per = (numel + n - 1) / n;
    for (int j = 0; j < n; ++j) {
      const int64_t lo = std::min(numel, j * per), hi = std::min(numel, (j + 1) * per);
      block_off_[j] = lo * elem_;
      block_len_[j] = (hi - lo) * elem_;
    }
  }

  void read_round(Context& ctx, int64_t k) override {
    const int me = ctx.rank, n = ctx.world;
    if (!two_shot()) {
      reduce_whole_round(ctx, k);
    } else {
      const Piece pc = piece(me, k);
      for (int p = 0; p < n; ++p) srcs_[p] = source(ctx, p, k, pc.off, me * piece_bytes_);
      // The reduced piece goes to its slot's result area, or zero-copy, in place into this
      // rank's own tensor (where peers read it next).
      char* dst = zero_copy_ ? out_ + pc.off : slot(ctx, me, k) + pieces_ * piece_bytes_;
      kernels::reduce(args_.input.scalar_type(), args_.red_op, dst, srcs_.data(), n, pc.len / elem_, n);
    }
  }

  // Two-shot's second half: copy every rank's reduced piece of each round into the output.
  bool after_reads(Context& ctx) override {
    const CollectiveWindow& W = ctx.coll;
    const int me = ctx.rank, n = ctx.world;
    bool progress = false;
    while (two_shot() && gathered_ < read_) {
      const int64_t k = gathered_;
      const uint64_t need = stream_value(seq(), k + 1);
      for (int d = 1; d < n; ++d) {
        const int p = (me + d) % n;
        if (signal_acquire(W.reduced(ctx.peer(p))) < need) {
          waiting(p, "its reduced piece");
          return progress;
        }
      }
      for (int d = 0; d < n; ++d) {
        const int p = (me + d) % n;
        const Piece pc = piece(p, k);
        const char* src = zero_copy_ ? heap_src_[p] + pc.off : slot(ctx, p, k) + pieces_ * piece_bytes_;
        if (src != out_ + pc.off) kernels::copy_bytes(out_ + pc.off, src, pc.len);
        if (zero_copy_ && p != me) ctx.stats.add(ctx.stats.heap_read_bytes, pc.len);
      }
      for (int p = 0; p < n; ++p) {
        if (p != me) signal_release(W.consumed(ctx.me, p), need);
      }
      ++gathered_;
      progress = true;
    }
    return progress;
  }
};

}  // namespace

std::shared_ptr<CollectiveOp> make_all_reduce_op(const char* name, CollKind kind, uint64_t seq,
                                                 Clock::time_point deadline, StagedRoundsArgs args) {
  return std::make_shared<AllReduceOp>(name, kind, seq, deadline, std::move(args));
}

}  // namespace cam
