// reduce as staged rounds (staged_rounds.hpp): every rank but the root stages; the root reduces.
#include "staged_rounds.hpp"

namespace cam {
namespace {

class ReduceOp final : public StagedRoundsOp {
 public:
  ReduceOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, StagedRoundsArgs&& args)
      : StagedRoundsOp(name, kind, seq, deadline, shape(), std::move(args)) {}

 private:
  static Shape shape() {
    Shape s;
    s.root_only = true;
    s.reduces = true;
    s.eager = true;
    s.reads_in_place = false;  // the root writes its output while peers would still read it
    return s;
  }

  void read_round(Context& ctx, int64_t k) override { reduce_whole_round(ctx, k); }
};

}  // namespace

std::shared_ptr<CollectiveOp> make_reduce_op(const char* name, CollKind kind, uint64_t seq,
                                             Clock::time_point deadline, StagedRoundsArgs args) {
  return std::make_shared<ReduceOp>(name, kind, seq, deadline, std::move(args));
}

}  // namespace cam
