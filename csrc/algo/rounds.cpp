#include "rounds.hpp"

#include <algorithm>

#include "../../kernels/copy.hpp"

namespace cam {

const char* rounds_mode_name(RoundsMode m) {
  switch (m) {
    case RoundsMode::kAllReduceOneShot: return "one-shot";
    case RoundsMode::kAllReduceTwoShot: return "two-shot (reduce-scatter + all-gather)";
    case RoundsMode::kReduce: return "reduce";
    case RoundsMode::kReduceScatter: return "reduce-scatter";
    case RoundsMode::kAllGather: return "all-gather";
    case RoundsMode::kGather: return "gather";
    case RoundsMode::kAllReduceEager: return "eager one-shot";
  }
  return "unknown";
}

RoundsOp::RoundsOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline,
                   RoundsArgs args)
    : CollectiveOp(name, kind, seq, deadline), a_(std::move(args)) {
  in_ = static_cast<char*>(a_.input.data_ptr());
  out_ = a_.output.defined() ? static_cast<char*>(a_.output.data_ptr()) : nullptr;
  in_bytes_ = int64_t(a_.input.nbytes());
  elem_ = int64_t(a_.input.element_size());
  outputs_ = std::move(a_.outputs);
}

void RoundsOp::fill_desc(Context& ctx, CollDesc* d) {
  d->root = a_.root;
  d->dtype = int32_t(a_.input.scalar_type());
  d->elem_size = int32_t(elem_);
  d->nbytes = in_bytes_;
  d->red_op = int32_t(a_.red_op);
  d->algo = int32_t(a_.mode);
  if (a_.mode == RoundsMode::kAllReduceEager) {
    // Published by the descriptor's release below; see CollectiveWindow::eager for why the half
    // is free.
    kernels::copy_bytes(ctx.coll.eager(ctx.me, seq()), in_, in_bytes_);
    ctx.stats.add(ctx.stats.staged_bytes, in_bytes_);
  }
  d->heap_off = ctx.heap_offset(in_, in_bytes_);
  if (a_.mode == RoundsMode::kReduceScatter) {
    int64_t* blocks = ctx.coll.desc_send_bytes(d);
    for (int j = 0; j < ctx.world; ++j) blocks[j] = block_bytes(ctx, j);
  }
}

int64_t RoundsOp::block_bytes(Context& ctx, int j) const {
  return a_.blocks.empty() ? in_bytes_ / ctx.world : a_.blocks[j];
}

void RoundsOp::validate(Context& ctx, const std::vector<const CollDesc*>& descs) {
  auto who = [&](int r) { return r == ctx.rank ? std::string("this rank") : str("rank ", r); };
  const int dtype = int32_t(a_.input.scalar_type());
  for (int r = 0; r < ctx.world; ++r) {
    if (descs[r]->algo == 0 && kind_ == CollKind::kAllGather) {
      refuse(ctx, uneven_all_gather_mismatch(r, false));
    }
  }
  for (int r = 0; r < ctx.world; ++r) {
    const CollDesc* d = descs[r];
    if (root_only() && d->root != a_.root) {
      refuse(ctx, str(who(r), " uses root ", d->root, " while this rank uses root ", a_.root));
    }
    if (d->dtype != dtype || d->nbytes != in_bytes_) {
      refuse(ctx, str(who(r), " contributes ", describe_bytes(d->nbytes, d->dtype),
                      " while this rank contributes ", describe_bytes(in_bytes_, dtype),
                      "; every rank must pass the same dtype and size"));
    }
    if (reduces() && d->red_op != int32_t(a_.red_op)) {
      refuse(ctx, str(who(r), " reduces with ", kernels::red_op_name(kernels::RedOp(d->red_op)),
                      " while this rank reduces with ", kernels::red_op_name(a_.red_op)));
    }
    if (d->algo != int32_t(a_.mode)) {
      refuse(ctx, str(who(r), " chose the ", rounds_mode_name(RoundsMode(d->algo)),
                      " algorithm while this rank chose ", rounds_mode_name(a_.mode),
                      "; the all_reduce algorithm options must be the same on every rank"));
    }
  }
  if (a_.mode == RoundsMode::kReduceScatter) {
    for (int r = 0; r < ctx.world; ++r) {
      const int64_t* theirs = ctx.coll.desc_send_bytes(descs[r]);
      for (int j = 0; j < ctx.world; ++j) {
        if (theirs[j] != block_bytes(ctx, j)) {
          refuse(ctx, str(who(r), " gives rank ", j, " a block of ",
                          describe_bytes(theirs[j], dtype), " while this rank gives it ",
                          describe_bytes(block_bytes(ctx, j), dtype),
                          "; every rank must split its input the same way"));
        }
      }
    }
  }
  // Zero-copy needs every input in the heap, and a mode that never writes what peers read.
  zero_copy_ = ctx.world > 1 && in_bytes_ > 0 && a_.mode != RoundsMode::kAllReduceOneShot &&
               a_.mode != RoundsMode::kReduce && a_.mode != RoundsMode::kAllReduceEager;
  for (int r = 0; r < ctx.world && zero_copy_; ++r) zero_copy_ = descs[r]->heap_off >= 0;
  if (zero_copy_) {
    heap_src_.assign(ctx.world, nullptr);
    for (int r = 0; r < ctx.world; ++r) heap_src_[r] = ctx.peer_heap(r, descs[r]->heap_off);
  }
}

void RoundsOp::plan(Context& ctx) {
  const int n = ctx.world, me = ctx.rank;
  const bool split = a_.mode == RoundsMode::kReduceScatter || a_.mode == RoundsMode::kAllReduceTwoShot;
  parts_ = split ? n : 1;
  result_area_ = a_.mode == RoundsMode::kAllReduceTwoShot;
  block_off_.assign(parts_, 0);
  block_len_.assign(parts_, in_bytes_);
  if (a_.mode == RoundsMode::kReduceScatter) {
    int64_t off = 0;
    for (int j = 0; j < n; ++j) {
      block_len_[j] = block_bytes(ctx, j);
      block_off_[j] = off;
      off += block_len_[j];
    }
  } else if (a_.mode == RoundsMode::kAllReduceTwoShot) {
    // Split by elements; the last blocks may be shorter (or empty).
    const int64_t numel = in_bytes_ / elem_, per = (numel + n - 1) / n;
    for (int j = 0; j < n; ++j) {
      const int64_t lo = std::min(numel, j * per), hi = std::min(numel, (j + 1) * per);
      block_off_[j] = lo * elem_;
      block_len_[j] = (hi - lo) * elem_;
    }
  }
  const int areas = parts_ + (result_area_ ? 1 : 0);
  const int64_t region = ctx.coll.staging_bytes();
  sub_ = std::min<int64_t>(ctx.cfg.chunk_bytes, region / (2 * areas)) / 64 * 64;
  TORCH_INTERNAL_ASSERT(sub_ >= 64, where(ctx.rank), ": staging region too small");
  slot_bytes_ = sub_ * areas;
  nslots_ = region / slot_bytes_;
  nrounds_ = (*std::max_element(block_len_.begin(), block_len_.end()) + sub_ - 1) / sub_;
  // Who reads whose slots: in the root modes only the root reads, and nobody reads the root's.
  reads_ = !root_only() || me == a_.root;
  stages_ = n > 1 && (!root_only() || me != a_.root) && !zero_copy_ &&
            a_.mode != RoundsMode::kAllReduceEager;
  if (a_.mode == RoundsMode::kAllReduceEager) nrounds_ = in_bytes_ > 0 ? 1 : 0;
  srcs_.assign(n, nullptr);
}

RoundsOp::Piece RoundsOp::piece(int part, int64_t round) const {
  const int64_t start = round * sub_;
  const int64_t len = std::max<int64_t>(0, std::min(sub_, block_len_[part] - start));
  return {block_off_[part] + start, len};
}

char* RoundsOp::slot(Context& ctx, int rank, int64_t round) const {
  return ctx.coll.staging(ctx.peer(rank)) + (round % nslots_) * slot_bytes_;
}

bool RoundsOp::stage(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  const int me = ctx.rank;
  bool progress = false;
  while (stages_ && staged_ < nrounds_) {
    const int64_t k = staged_;
    if (k >= nslots_) {
      const uint64_t need = stream_value(seq(), k - nslots_ + 1);
      for (int p = 0; p < ctx.world; ++p) {
        if (p == me || (root_only() && p != a_.root)) continue;
        if (signal_acquire(W.consumed(ctx.peer(p), me)) < need) {
          waiting(p, "release of a staging slot");
          return progress;
        }
      }
      // The result area of this slot is also read by this rank itself (two-shot).
      if (result_area_ && gathered_ < k - nslots_ + 1) return progress;
    }
    char* dst = slot(ctx, me, k);
    for (int j = 0; j < parts_; ++j) {
      if (parts_ > 1 && j == me) continue;  // only this rank reads its own piece
      const Piece pc = piece(j, k);
      kernels::copy_bytes(dst + j * sub_, in_ + pc.off, pc.len);
      ctx.stats.add(ctx.stats.staged_bytes, pc.len);
    }
    kernels::store_fence();
    signal_release(W.produced(ctx.me, me), stream_value(seq(), k + 1));
    ++staged_;
    progress = true;
  }
  return progress;
}

bool RoundsOp::combine(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  const int me = ctx.rank, n = ctx.world;
  bool progress = false;
  while (reads_ && combined_ < nrounds_) {
    const int64_t k = combined_;
    // In place, the output overwrites the input: stage this round before changing it.
    if (stages_ && staged_ <= k) return progress;
    const uint64_t need = stream_value(seq(), k + 1);
    if (a_.mode == RoundsMode::kAllReduceEager) {
      for (int p = 0; p < n; ++p) srcs_[p] = p == me ? in_ : ctx.coll.eager(ctx.peer(p), seq());
      kernels::reduce(a_.input.scalar_type(), a_.red_op, out_, srcs_.data(), n, in_bytes_ / elem_, n);
      ++combined_;
      return true;
    }
    for (int d = 1; d < n && !zero_copy_; ++d) {
      const int p = (me + d) % n;
      if (signal_acquire(W.produced(ctx.peer(p), p)) < need) {
        waiting(p, "staged data");
        return progress;
      }
    }
    switch (a_.mode) {
      case RoundsMode::kAllReduceOneShot:
      case RoundsMode::kReduce: {
        const Piece pc = piece(0, k);
        for (int p = 0; p < n; ++p) srcs_[p] = source(ctx, p, k, pc.off, 0);
        kernels::reduce(a_.input.scalar_type(), a_.red_op, out_ + pc.off, srcs_.data(), n,
                        pc.len / elem_, n);
        break;
      }
      case RoundsMode::kReduceScatter:
      case RoundsMode::kAllReduceTwoShot: {
        const Piece pc = piece(me, k);
        for (int p = 0; p < n; ++p) srcs_[p] = source(ctx, p, k, pc.off, me * sub_);
        // Two-shot publishes the reduced piece in its slot's result area, or zero-copy, in
        // place in its own tensor (where peers read it next).
        char* dst = a_.mode == RoundsMode::kReduceScatter ? out_ + k * sub_
                    : zero_copy_                          ? out_ + pc.off
                                                          : slot(ctx, me, k) + parts_ * sub_;
        kernels::reduce(a_.input.scalar_type(), a_.red_op, dst, srcs_.data(), n, pc.len / elem_, n);
        break;
      }
      case RoundsMode::kAllGather:
      case RoundsMode::kGather: {
        const Piece pc = piece(0, k);
        for (int d = 0; d < n; ++d) {
          const int p = (me + d) % n;
          char* dst = out_ + p * in_bytes_ + pc.off;
          const char* src = source(ctx, p, k, pc.off, 0);
          if (dst != src) kernels::copy_bytes(dst, src, pc.len);
        }
        break;
      }
    }
    if (zero_copy_) {
      const int part = parts_ > 1 ? me : 0;
      ctx.stats.add(ctx.stats.heap_read_bytes, piece(part, k).len * (n - 1));
    }
    if (result_area_) {
      kernels::store_fence();
      signal_release(W.reduced(ctx.me), need);
    } else {
      for (int p = 0; p < n; ++p) {
        if (p != me) signal_release(W.consumed(ctx.me, p), need);
      }
    }
    ++combined_;
    progress = true;
  }
  return progress;
}

bool RoundsOp::gather_reduced(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  const int me = ctx.rank, n = ctx.world;
  bool progress = false;
  while (result_area_ && gathered_ < combined_) {
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
      const char* src = zero_copy_ ? heap_src_[p] + pc.off : slot(ctx, p, k) + parts_ * sub_;
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

bool RoundsOp::readers_released(Context& ctx) {
  if (!zero_copy_) return true;
  const uint64_t need = stream_value(seq(), uint64_t(nrounds_));
  for (int p = 0; p < ctx.world; ++p) {
    if (p == ctx.rank || (root_only() && p != a_.root)) continue;
    if (signal_acquire(ctx.coll.consumed(ctx.peer(p), ctx.rank)) < need) {
      waiting(p, "the release of this rank's heap tensor");
      return false;
    }
  }
  return true;
}

bool RoundsOp::data_step(Context& ctx) {
  if (nrounds_ < 0) plan(ctx);
  bool progress = stage(ctx);
  progress |= combine(ctx);
  progress |= gather_reduced(ctx);
  const int64_t last = result_area_ ? gathered_ : combined_;
  if ((!stages_ || staged_ == nrounds_) && (!reads_ || last == nrounds_) && readers_released(ctx)) {
    mark_done();
    return true;
  }
  return progress;
}

void RoundsOp::finalize() {
  for (auto& [dst, src] : a_.copy_back) dst.copy_(src);
}

}  // namespace cam
