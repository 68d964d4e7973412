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

CollKind coll_kind_of(const std::string& name) {
  for (int k = int(CollKind::kBarrier); k <= int(CollKind::kMoeCombine); ++k) {
    if (name == coll_kind_name(CollKind(k))) return CollKind(k);
  }
  TORCH_CHECK_VALUE(false, "cam: no collective is named '", name, "'");
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

void CollectiveOp::publish(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  CollDesc* d = W.desc(ctx.me, seq());
  std::memset(d, 0, W.desc_fixed_bytes());
  d->op = int32_t(kind_);
  fill_desc(ctx, d);
  d->seq = seq();
  signal_release(W.desc_seq(ctx.me), seq());
}

void CollectiveOp::check_peer_descriptor(Context& ctx, int r, const CollDesc* d) const {
  if (d->refused) {
    const char* text = ctx.coll.desc_refusal(d);
    std::string why(text, strnlen(text, kRefusalTextBytes));
    refuse(ctx, r == ctx.rank ? why : str("rank ", r, " refused its arguments: ", why));
  }
  if (d->op != int32_t(kind_)) {
    refuse(ctx, str("rank ", r, " issued ", coll_kind_name(CollKind(d->op)), " as its collective #", seq(),
                    " while this rank issued ", coll_kind_name(kind_),
                    "; every rank of a group must issue the same collectives in the same order"));
  }
}

void CollectiveOp::check_descriptors(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  std::vector<const CollDesc*> descs(ctx.world);
  for (int r = 0; r < ctx.world; ++r) {
    descs[r] = W.desc(ctx.peer(r), seq());
    TORCH_INTERNAL_ASSERT(descs[r]->seq == seq(), where(ctx.rank), ": rank ", r,
                          " descriptor slot holds seq ", descs[r]->seq);
  }
  check_peer_descriptor(ctx, ctx.rank, descs[ctx.rank]);  // its own reason first, if it refused
  for (int r = 0; r < ctx.world; ++r) {
    if (r != ctx.rank) check_peer_descriptor(ctx, r, descs[r]);
  }
  validate(ctx, descs);
}

bool CollectiveOp::step(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  bool progress = false;
  if (phase_ == Phase::kPublish) {
    publish(ctx);
    phase_ = Phase::kExchange;
    progress = true;
    if (record_arrivals_) {
      published_at_ = Clock::now();
      arrival_us_.assign(ctx.world, -1);
      arrival_us_[ctx.rank] = 0;
    }
  }
  if (phase_ == Phase::kExchange) {
    if (record_arrivals_) {
      const auto now = Clock::now();
      for (int p = 0; p < ctx.world; ++p) {
        if (arrival_us_[p] < 0 && signal_acquire(W.desc_seq(ctx.peer(p))) >= seq()) {
          arrival_us_[p] = std::chrono::duration_cast<std::chrono::microseconds>(now - published_at_).count();
        }
      }
    }
    for (; next_peer_ < ctx.world; ++next_peer_) {
      if (next_peer_ == ctx.rank) continue;
      if (signal_acquire(W.desc_seq(ctx.peer(next_peer_))) < seq()) {
        waiting(next_peer_, "the collective descriptor");
        return progress;
      }
    }
    // Move to the data phase before checking: a refused op is finished either way, and the
    // next collective starts from a clean exchange.
    phase_ = Phase::kData;
    check_descriptors(ctx);
    progress = true;
  }
  progress |= data_step(ctx);
  return progress;
}

void RefusedOp::fill_desc(Context& ctx, CollDesc* d) {
  d->refused = 1;
  char* text = ctx.coll.desc_refusal(d);
  const size_t n = std::min(reason_.size(), kRefusalTextBytes - 1);
  std::memcpy(text, reason_.data(), n);
  text[n] = 0;
}

bool MonitoredBarrierOp::step(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  bool progress = false;
  my_rank_ = ctx.rank;
  if (!published_) {
    publish(ctx);
    published_ = true;
    progress = true;
  }
  if (ctx.rank == 0) {
    missing_.clear();
    for (int p = 1; p < ctx.world; ++p) {
      if (signal_acquire(W.desc_seq(ctx.peer(p))) < seq()) missing_.push_back(p);
    }
    if (!missing_.empty()) return progress;
    // Every rank has published seq, so each finished seq - 1 and reads no counter of it.
    for (int p = 1; p < ctx.world; ++p) signal_release(W.produced(ctx.me, p), stream_value(seq(), 1));
  } else if (signal_acquire(W.produced(ctx.peer(0), ctx.rank)) < stream_value(seq(), 1)) {
    // Rank 0 refused, or issued another collective: it will never release this barrier.
    if (signal_acquire(W.desc_seq(ctx.peer(0))) >= seq()) {
      const CollDesc* d0 = W.desc(ctx.peer(0), seq());
      if (d0->seq == seq()) check_peer_descriptor(ctx, 0, d0);
    }
    return progress;
  }
  check_descriptors(ctx);
  mark_done();
  return true;
}

std::string monitored_barrier_waiting_for(int rank, const std::vector<int>& missing, bool wait_all_ranks,
                                          int64_t timeout_ms) {
  if (rank > 0) {
    return str("rank 0 to release the barrier (it does once every rank has arrived): Rank ", rank,
               " successfully reached monitoredBarrier, but received errors while waiting for send/recv "
               "from rank 0");
  }
  std::string ranks;
  for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (timeout_ms == 0) {
    return str("ranks [", ranks, "] to reach the barrier: Rank ", rank, " timed out in monitoredBarrier after 0 ms");
  }
  if (!wait_all_ranks) {
    return str("rank ", missing[0], " to reach the barrier: Rank ", missing[0], " failed to pass monitoredBarrier in ",
               timeout_ms, " ms");
  }
  return str("ranks [", ranks, "] to reach the barrier (", missing.size(),
             missing.size() == 1 ? " rank has" : " ranks have", " not arrived): ",
             missing.size() == 1 ? "Rank " : "Ranks ", ranks, " failed to pass monitoredBarrier in ", timeout_ms,
             " ms");
}

std::string MonitoredBarrierOp::waiting_for() const {
  if (my_rank_ <= 0 && missing_.empty()) return Op::waiting_for();
  return monitored_barrier_waiting_for(my_rank_, missing_, wait_all_, timeout_ms());
}

}  // namespace cam
