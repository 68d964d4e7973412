// reduce_scatter as staged rounds (staged_rounds.hpp): every rank stages block j of its input
// for rank j, and rank j reduces block j of every input into its output. Blocks may differ in
// size (uneven output lists); every rank must split alike.
#include "staged_rounds.hpp"

namespace cam {
namespace {

class ReduceScatterOp final : public StagedRoundsOp {
 public:
  ReduceScatterOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, StagedRoundsArgs&& args)
      : StagedRoundsOp(name, kind, seq, deadline, shape(), std::move(args)) {}

 private:
  static Shape shape() {
    Shape s;
    s.reduces = true;
    s.split = true;
    s.eager = true;
    return s;
  }
  int64_t block_bytes(Context& ctx, int j) const {
    return args_.blocks.empty() ? in_bytes_ / ctx.world : args_.blocks[j];
  }

  void fill_desc_extra(Context& ctx, CollDesc* d) override {
    int64_t* blocks = ctx.coll.desc_send_bytes(d);
    for (int j = 0; j < ctx.world; ++j) blocks[j] = block_bytes(ctx, j);
  }

  void validate_blocks(Context& ctx, const std::vector<const CollDesc*>& descs) override {
    const int dtype = int32_t(args_.input.scalar_type());
    for (int r = 0; r < ctx.world; ++r) {
      const int64_t* theirs = ctx.coll.desc_send_bytes(descs[r]);
      for (int j = 0; j < ctx.world; ++j) {
        if (theirs[j] != block_bytes(ctx, j)) {
          refuse(ctx, str(r == ctx.rank ? std::string("this rank") : str("rank ", r), " gives rank ", j,
                          " a block of ", describe_bytes(theirs[j], dtype), " while this rank gives it ",
                          describe_bytes(block_bytes(ctx, j), dtype),
                          "; every rank must split its input the same way"));
        }
      }
    }
  }

  void split_blocks(Context& ctx) override {
    int64_t off = 0;
    for (int j = 0; j < ctx.world; ++j) {
      block_len_[j] = block_bytes(ctx, j);
      block_off_[j] = off;
      off += block_len_[j];
    }
  }

  void read_round(Context& ctx, int64_t k) override {
    const int me = ctx.rank, n = ctx.world;
    const Piece pc = piece(me, k);
    for (int p = 0; p < n; ++p) srcs_[p] = source(ctx, p, k, pc.off, me * piece_bytes_);
    kernels::reduce(args_.input.scalar_type(), args_.red_op, out_ + k * piece_bytes_, srcs_.data(), n,
                    pc.len / elem_, n);
  }
};

}  // namespace

std::shared_ptr<CollectiveOp> make_reduce_scatter_op(const char* name, CollKind kind, uint64_t seq,
                                                     Clock::time_point deadline, StagedRoundsArgs args) {
  return std::make_shared<ReduceScatterOp>(name, kind, seq, deadline, std::move(args));
}

}  // namespace cam
