#include "staged_rounds.hpp"

#include <algorithm>

#include "../../kernels/copy.hpp"

namespace cam {

const char* staged_algo_name(StagedAlgo a) {
  switch (a) {
    case StagedAlgo::kAllReduceOneShot: return "one-shot";
    case StagedAlgo::kAllReduceTwoShot: return "two-shot (reduce-scatter + all-gather)";
    case StagedAlgo::kReduce: return "reduce";
    case StagedAlgo::kReduceScatter: return "reduce-scatter";
    case StagedAlgo::kAllGather: return "all-gather";
    case StagedAlgo::kGather: return "gather";
    case StagedAlgo::kAllReduceEager: return "eager one-shot";
  }
  return "unknown";
}

std::shared_ptr<CollectiveOp> make_staged_rounds_op(const char* name, CollKind kind, uint64_t seq,
                                                    Clock::time_point deadline, StagedRoundsArgs args) {
  switch (args.algo) {
    case StagedAlgo::kAllReduceOneShot:
    case StagedAlgo::kAllReduceTwoShot:
    case StagedAlgo::kAllReduceEager: return make_all_reduce_op(name, kind, seq, deadline, std::move(args));
    case StagedAlgo::kReduce: return make_reduce_op(name, kind, seq, deadline, std::move(args));
    case StagedAlgo::kReduceScatter: return make_reduce_scatter_op(name, kind, seq, deadline, std::move(args));
    case StagedAlgo::kAllGather:
    case StagedAlgo::kGather: return make_all_gather_op(name, kind, seq, deadline, std::move(args));
  }
  TORCH_INTERNAL_ASSERT(false, "cam: unknown staged algorithm ", int(args.algo));
}

StagedRoundsOp::StagedRoundsOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline,
                               Shape shape, StagedRoundsArgs&& args)
    : CollectiveOp(name, kind, seq, deadline), shape_(shape), args_(std::move(args)) {
  in_ = static_cast<char*>(args_.input.data_ptr());
  out_ = args_.output.defined() ? static_cast<char*>(args_.output.data_ptr()) : nullptr;
  in_bytes_ = int64_t(args_.input.nbytes());
  elem_ = int64_t(args_.input.element_size());
  outputs_ = std::move(args_.outputs);
}

void StagedRoundsOp::fill_desc(Context& ctx, CollDesc* d) {
  d->root = args_.root;
  d->dtype = int32_t(args_.input.scalar_type());
  d->elem_size = int32_t(elem_);
  d->nbytes = in_bytes_;
  d->red_op = int32_t(args_.red_op);
  d->algo = int32_t(args_.algo);
  // Every rank decides alike: the sizes are validated equal before anyone reads.
  eager_ = shape_.eager && ctx.world > 1 && ctx.coll.eager_fits(in_bytes_);
  if (eager_ && !(shape_.root_only && ctx.rank == args_.root)) {  // a root's input has no reader
    kernels::copy_bytes(ctx.coll.eager(ctx.me, seq()), in_, in_bytes_);
    ctx.stats.add(ctx.stats.staged_bytes, in_bytes_);
  }
  fill_desc_extra(ctx, d);
  d->heap_off = ctx.heap_offset(in_, in_bytes_);
}

void StagedRoundsOp::validate(Context& ctx, const std::vector<const CollDesc*>& descs) {
  auto who = [&](int r) { return r == ctx.rank ? std::string("this rank") : str("rank ", r); };
  const int dtype = int32_t(args_.input.scalar_type());
  validate_path(ctx, descs);
  for (int r = 0; r < ctx.world; ++r) {
    const CollDesc* d = descs[r];
    if (shape_.root_only && d->root != args_.root) {
      refuse(ctx, str(who(r), " uses root ", d->root, " while this rank uses root ", args_.root));
    }
    if (d->dtype != dtype || d->nbytes != in_bytes_) {
      refuse(ctx, str(who(r), " contributes ", describe_bytes(d->nbytes, d->dtype),
                      " while this rank contributes ", describe_bytes(in_bytes_, dtype),
                      "; every rank must pass the same dtype and size"));
    }
    if (shape_.reduces && d->red_op != int32_t(args_.red_op)) {
      refuse(ctx, str(who(r), " reduces with ", kernels::red_op_name(kernels::RedOp(d->red_op)),
                      " while this rank reduces with ", kernels::red_op_name(args_.red_op)));
    }
    if (d->algo != int32_t(args_.algo)) {
      refuse(ctx, str(who(r), " chose the ", staged_algo_name(StagedAlgo(d->algo)),
                      " algorithm while this rank chose ", staged_algo_name(args_.algo),
                      "; the all_reduce algorithm options must be the same on every rank"));
    }
  }
  validate_blocks(ctx, descs);
  zero_copy_ = !eager_ && shape_.reads_in_place && ctx.world > 1 && in_bytes_ > 0;
  for (int r = 0; r < ctx.world && zero_copy_; ++r) zero_copy_ = descs[r]->heap_off >= 0;
  if (zero_copy_) {
    heap_src_.assign(ctx.world, nullptr);
    for (int r = 0; r < ctx.world; ++r) heap_src_[r] = ctx.peer_heap(r, descs[r]->heap_off);
  }
}

void StagedRoundsOp::split_blocks(Context&) {}

void StagedRoundsOp::plan(Context& ctx) {
  const int n = ctx.world, me = ctx.rank;
  pieces_ = shape_.split ? n : 1;
  block_off_.assign(pieces_, 0);
  block_len_.assign(pieces_, in_bytes_);
  split_blocks(ctx);
  const int areas = pieces_ + (shape_.result_area ? 1 : 0);
  const int64_t region = ctx.coll.staging_bytes();
  piece_bytes_ = std::min<int64_t>(ctx.cfg.chunk_bytes, region / (2 * areas)) / 64 * 64;
  TORCH_INTERNAL_ASSERT(piece_bytes_ >= 64, where(ctx.rank), ": staging region too small");
  slot_bytes_ = piece_bytes_ * areas;
  nslots_ = region / slot_bytes_;
  nrounds_ = (*std::max_element(block_len_.begin(), block_len_.end()) + piece_bytes_ - 1) / piece_bytes_;
  // Who reads whose slots: in the root shapes only the root reads, and nobody reads the root's.
  reads_ = !shape_.root_only || me == args_.root;
  stages_ = n > 1 && (!shape_.root_only || me != args_.root) && !zero_copy_ && !eager_;
  if (eager_) {  // read whole, in one round
    piece_bytes_ = in_bytes_;
    nrounds_ = 1;
  }
  srcs_.assign(n, nullptr);
}

StagedRoundsOp::Piece StagedRoundsOp::piece(int part, int64_t round) const {
  const int64_t start = round * piece_bytes_;
  const int64_t len = std::max<int64_t>(0, std::min(piece_bytes_, block_len_[part] - start));
  return {block_off_[part] + start, len};
}

char* StagedRoundsOp::slot(Context& ctx, int rank, int64_t round) const {
  return ctx.coll.staging(ctx.peer(rank)) + (round % nslots_) * slot_bytes_;
}

void StagedRoundsOp::reduce_whole_round(Context& ctx, int64_t k) {
  const Piece pc = piece(0, k);
  for (int p = 0; p < ctx.world; ++p) srcs_[p] = source(ctx, p, k, pc.off, 0);
  kernels::reduce(args_.input.scalar_type(), args_.red_op, out_ + pc.off, srcs_.data(), ctx.world,
                  pc.len / elem_, ctx.world);
}

bool StagedRoundsOp::stage_rounds(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  const int me = ctx.rank;
  bool progress = false;
  while (stages_ && staged_ < nrounds_) {
    const int64_t k = staged_;
    if (k >= nslots_) {
      const uint64_t need = stream_value(seq(), k - nslots_ + 1);
      for (int p = 0; p < ctx.world; ++p) {
        if (p == me || (shape_.root_only && p != args_.root)) continue;
        if (signal_acquire(W.consumed(ctx.peer(p), me)) < need) {
          waiting(p, "release of a staging slot");
          return progress;
        }
      }
      // The result area of this slot is also read by this rank itself (two-shot).
      if (shape_.result_area && gathered_ < k - nslots_ + 1) return progress;
    }
    char* dst = slot(ctx, me, k);
    for (int j = 0; j < pieces_; ++j) {
      if (pieces_ > 1 && j == me) continue;  // only this rank reads its own piece
      const Piece pc = piece(j, k);
      kernels::copy_bytes(dst + j * piece_bytes_, in_ + pc.off, pc.len);
      ctx.stats.add(ctx.stats.staged_bytes, pc.len);
    }
    kernels::store_fence();
    signal_release(W.produced(ctx.me, me), stream_value(seq(), k + 1));
    ++staged_;
    progress = true;
  }
  return progress;
}

bool StagedRoundsOp::read_rounds(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  const int me = ctx.rank, n = ctx.world;
  bool progress = false;
  while (reads_ && read_ < nrounds_) {
    const int64_t k = read_;
    // In place, the output overwrites the input: stage this round before changing it.
    if (stages_ && staged_ <= k) return progress;
    const uint64_t need = stream_value(seq(), k + 1);
    for (int d = 1; d < n && !eager_ && !zero_copy_; ++d) {
      const int p = (me + d) % n;
      if (signal_acquire(W.produced(ctx.peer(p), p)) < need) {
        waiting(p, "staged data");
        return progress;
      }
    }
    read_round(ctx, k);
    if (zero_copy_) {
      const int part = pieces_ > 1 ? me : 0;
      ctx.stats.add(ctx.stats.heap_read_bytes, piece(part, k).len * (n - 1));
    }
    if (shape_.result_area) {
      kernels::store_fence();
      signal_release(W.reduced(ctx.me), need);
    } else if (!eager_) {
      for (int p = 0; p < n; ++p) {
        if (p != me) signal_release(W.consumed(ctx.me, p), need);
      }
    }
    ++read_;
    progress = true;
  }
  return progress;
}

bool StagedRoundsOp::readers_released(Context& ctx) {
  if (!zero_copy_) return true;
  const uint64_t need = stream_value(seq(), uint64_t(nrounds_));
  for (int p = 0; p < ctx.world; ++p) {
    if (p == ctx.rank || (shape_.root_only && p != args_.root)) continue;
    if (signal_acquire(ctx.coll.consumed(ctx.peer(p), ctx.rank)) < need) {
      waiting(p, "the release of this rank's heap tensor");
      return false;
    }
  }
  return true;
}

bool StagedRoundsOp::data_step(Context& ctx) {
  if (nrounds_ < 0) plan(ctx);
  bool progress = stage_rounds(ctx);
  progress |= read_rounds(ctx);
  progress |= after_reads(ctx);
  const int64_t last = shape_.result_area ? gathered_ : read_;
  if ((!stages_ || staged_ == nrounds_) && (!reads_ || last == nrounds_) && readers_released(ctx)) {
    mark_done();
    return true;
  }
  return progress;
}

void StagedRoundsOp::finalize() {
  for (auto& [dst, src] : args_.copy_back) dst.copy_(src);
}

}  // namespace cam
