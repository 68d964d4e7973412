// all_gather and gather as staged rounds (staged_rounds.hpp): every rank stages its chunk;
// readers (every rank, or only the root) copy every rank's chunk into its row of the output.
#include "../../kernels/copy.hpp"
#include "staged_rounds.hpp"

namespace cam {
namespace {

class AllGatherOp final : public StagedRoundsOp {
 public:
  AllGatherOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, StagedRoundsArgs&& args)
      : StagedRoundsOp(name, kind, seq, deadline, shape_of(args.algo), std::move(args)) {}

 private:
  static Shape shape_of(StagedAlgo algo) {
    Shape s;
    s.root_only = algo == StagedAlgo::kGather;
    s.eager = true;
    return s;
  }

  // A rank whose outputs differ in size took the all-to-all path instead.
  void validate_path(Context& ctx, const std::vector<const CollDesc*>& descs) override {
    if (args_.algo != StagedAlgo::kAllGather) return;
    for (int r = 0; r < ctx.world; ++r) {
      if (descs[r]->algo == 0) refuse(ctx, uneven_all_gather_mismatch(r, false));
    }
  }

  void read_round(Context& ctx, int64_t k) override {
    const int me = ctx.rank, n = ctx.world;
    const Piece pc = piece(0, k);
    for (int d = 0; d < n; ++d) {
      const int p = (me + d) % n;
      char* dst = out_ + p * in_bytes_ + pc.off;
      const char* src = source(ctx, p, k, pc.off, 0);
      if (dst != src) kernels::copy_bytes(dst, src, pc.len);
    }
  }
};

}  // namespace

std::shared_ptr<CollectiveOp> make_all_gather_op(const char* name, CollKind kind, uint64_t seq,
                                                 Clock::time_point deadline, StagedRoundsArgs args) {
  return std::make_shared<AllGatherOp>(name, kind, seq, deadline, std::move(args));
}

}  // namespace cam
