#include "collective.hpp"

#include <cstring>

namespace cam {

const char* coll_kind_name(CollKind k) {
  switch (k) {
    case CollKind::kBarrier: return "barrier";
    case CollKind::kBroadcast: return "broadcast";
    case CollKind::kAllToAll: return "all_to_all";
    case CollKind::kAllReduce: return "all_reduce";
    case CollKind::kReduce: return "reduce";
    case CollKind::kAllGather: return "all_gather";
    case CollKind::kGather: return "gather";
    case CollKind::kReduceScatter: return "reduce_scatter";
    case CollKind::kScatter: return "scatter";
    case CollKind::kMoeDispatch: return "moe_dispatch";
    case CollKind::kMoeCombine: return "moe_combine";
  }
  return "unknown collective";
}

void CollectiveOp::refuse(Context& ctx, const std::string& what) const {
  throw ValidationError(where(ctx.rank) + ": " + what);
}

std::string uneven_all_gather_mismatch(int other, bool this_rank_uneven) {
  return this_rank_uneven
             ? str("rank ", other, " passes output tensors that all have its input's size, while "
                   "this rank's output sizes differ per rank (uneven all_gather); every rank must "
                   "pass the same output sizes")
             : str("rank ", other, " passes output tensors whose sizes differ per rank (uneven "
                   "all_gather), while every output tensor of this rank has its input's size; "
                   "every rank must pass the same output sizes");
}

std::string CollectiveOp::waiting_for() const {
  if (missing_.empty()) return Op::waiting_for();
  std::string ranks;
  for (int r : missing_) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  // Also in gloo's words, which tools and tests match on.
  if (timeout_ms() == 0) {
    return str("ranks [", ranks, "] to reach the barrier: Rank ", my_rank_,
               " timed out in monitoredBarrier after 0 ms");
  }
  return str("ranks [", ranks, "] to reach the barrier (", missing_.size(),
             missing_.size() == 1 ? " rank has" : " ranks have", " not arrived): ",
             missing_.size() == 1 ? "Rank " : "Ranks ", ranks, " failed to pass monitoredBarrier in ",
             timeout_ms(), " ms");
}

bool CollectiveOp::step(Context& ctx) {
  const WindowLayout& L = ctx.L;
  bool progress = false;
  if (phase_ == Phase::kPublish) {
    CollDesc* d = L.desc(ctx.me, seq());
    std::memset(d, 0, L.desc_slot_bytes());
    d->op = int32_t(kind_);
    fill_desc(ctx, d);
    d->seq = seq();
    signal_release(L.desc_seq(ctx.me), seq());
    phase_ = Phase::kExchange;
    progress = true;
    if (record_arrivals_) {
      published_at_ = Clock::now();
      arrival_us_.assign(ctx.world, -1);
      arrival_us_[ctx.rank] = 0;
    }
  }
  if (phase_ == Phase::kExchange) {
    if (name_all_missing_) {
      my_rank_ = ctx.rank;
      missing_.clear();
      for (int p = 0; p < ctx.world; ++p) {
        if (p != ctx.rank && signal_acquire(L.desc_seq(ctx.peer(p))) < seq()) missing_.push_back(p);
      }
    }
    if (record_arrivals_) {
      const auto now = Clock::now();
      for (int p = 0; p < ctx.world; ++p) {
        if (arrival_us_[p] < 0 && signal_acquire(L.desc_seq(ctx.peer(p))) >= seq()) {
          arrival_us_[p] = std::chrono::duration_cast<std::chrono::microseconds>(now - published_at_).count();
        }
      }
    }
    for (; next_peer_ < ctx.world; ++next_peer_) {
      if (next_peer_ == ctx.rank) continue;
      if (signal_acquire(L.desc_seq(ctx.peer(next_peer_))) < seq()) {
        waiting(next_peer_, "the collective descriptor");
        return progress;
      }
    }
    std::vector<const CollDesc*> descs(ctx.world);
    for (int r = 0; r < ctx.world; ++r) {
      descs[r] = L.desc(ctx.peer(r), seq());
      TORCH_INTERNAL_ASSERT(descs[r]->seq == seq(), where(ctx.rank), ": rank ", r,
                            " descriptor slot holds seq ", descs[r]->seq);
    }
    for (int r = 0; r < ctx.world; ++r) {
      if (descs[r]->op != int32_t(kind_)) {
        refuse(ctx, str("rank ", r, " issued ", coll_kind_name(CollKind(descs[r]->op)),
                        " as its collective #", seq(), " while this rank issued ",
                        coll_kind_name(kind_),
                        "; every rank of a group must issue the same collectives in the same "
                        "order"));
      }
    }
    // Move to the data phase before validating: a refused op is finished either way, and the
    // next collective starts from a clean exchange.
    phase_ = Phase::kData;
    validate(ctx, descs);
    progress = true;
  }
  progress |= data_step(ctx);
  return progress;
}

}  // namespace cam
