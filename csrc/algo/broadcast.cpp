#include "../../kernels/copy.hpp"
#include "collective.hpp"

namespace cam {

BroadcastOp::BroadcastOp(uint64_t seq, Clock::time_point deadline, int root, bool is_root,
                         at::Tensor tensor)
    : CollectiveOp("broadcast", CollKind::kBroadcast, seq, deadline), root_(root),
      user_(std::move(tensor)) {
  // The root streams from a contiguous view of its data; a receiver lands bytes in a
  // contiguous buffer and copies into a strided tensor once at the end.
  buf_ = is_root || user_.is_contiguous() ? user_.contiguous()
                                          : at::empty_like(user_, at::MemoryFormat::Contiguous);
  nbytes_ = int64_t(buf_.nbytes());
}

void BroadcastOp::fill_desc(Context& ctx, CollDesc* d) {
  d->root = root_;
  d->dtype = int32_t(buf_.scalar_type());
  d->elem_size = int32_t(buf_.element_size());
  d->nbytes = nbytes_;
  d->heap_off = ctx.rank == root_ ? ctx.heap_offset(buf_.data_ptr(), nbytes_) : -1;
  if (ctx.rank == root_ && ctx.world > 1 && ctx.coll.eager_fits(nbytes_)) {
    kernels::copy_bytes(ctx.coll.eager(ctx.me, seq()), buf_.data_ptr(), nbytes_);
    ctx.stats.add(ctx.stats.staged_bytes, nbytes_);
  }
}

void BroadcastOp::validate(Context& ctx, const std::vector<const CollDesc*>& descs) {
  for (int r = 0; r < ctx.world; ++r) {
    if (descs[r]->root != root_) {
      refuse(ctx, str("rank ", r, " broadcasts from root ", descs[r]->root,
                      " while this rank uses root ", root_));
    }
  }
  const CollDesc* root = descs[root_];
  for (int r = 0; r < ctx.world; ++r) {
    const CollDesc* d = descs[r];
    if (d->nbytes != root->nbytes || d->dtype != root->dtype) {
      refuse(ctx, str("root rank ", root_, " broadcasts ", describe_bytes(root->nbytes, root->dtype),
                      " but ", r == ctx.rank ? std::string("this rank") : str("rank ", r),
                      "'s tensor holds ", describe_bytes(d->nbytes, d->dtype)));
    }
  }
  root_heap_off_ = root->heap_off;
  eager_ = ctx.world > 1 && ctx.coll.eager_fits(nbytes_);  // the root's size, now that they agree
}

bool BroadcastOp::eager_step(Context& ctx) {
  if (ctx.rank != root_) {
    kernels::copy_bytes(buf_.data_ptr(), ctx.coll.eager(ctx.peer(root_), seq()), nbytes_);
  }
  mark_done();
  return true;
}

bool BroadcastOp::in_place_step(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  if (ctx.rank == root_) {
    // The receivers copy straight out of the root's tensor: it must stay untouched until
    // every one of them says it is done.
    for (int p = 0; p < ctx.world; ++p) {
      if (p != root_ && signal_acquire(W.consumed(ctx.peer(p), root_)) < stream_value(seq(), 1)) {
        waiting(p, "the in-place read of the broadcast tensor");
        return false;
      }
    }
    mark_done();
    return true;
  }
  // One piece per pass, so that p2p traffic beside the collective keeps flowing.
  const int64_t piece = std::min<int64_t>(kDirectPieceBytes, nbytes_ - next_chunk_);
  kernels::copy_bytes(static_cast<char*>(buf_.data_ptr()) + next_chunk_,
                      ctx.peer_heap(root_, root_heap_off_ + next_chunk_), piece);
  ctx.stats.add(ctx.stats.heap_read_bytes, piece);
  next_chunk_ += piece;
  if (next_chunk_ == nbytes_) {
    signal_release(W.consumed(ctx.me, root_), stream_value(seq(), 1));
    mark_done();
  }
  return true;
}

bool BroadcastOp::data_step(Context& ctx) {
  if (eager_) return eager_step(ctx);
  if (root_heap_off_ >= 0) return in_place_step(ctx);
  const CollectiveWindow& W = ctx.coll;
  if (nslots_ == 0) {
    slot_bytes_ = std::min<int64_t>(ctx.cfg.chunk_bytes, W.staging_bytes() / 2) / 64 * 64;
    nslots_ = W.staging_bytes() / slot_bytes_;
    nchunks_ = (nbytes_ + slot_bytes_ - 1) / slot_bytes_;
  }
  char* data = static_cast<char*>(buf_.data_ptr());
  bool progress = false;
  if (ctx.rank == root_) {
    char* region = W.staging(ctx.me);
    for (; next_chunk_ < nchunks_; ++next_chunk_) {
      const int64_t k = next_chunk_;
      if (k >= nslots_) {  // slot k % nslots last held chunk k - nslots: all readers done?
        for (int p = 0; p < ctx.world; ++p) {
          if (p != ctx.rank &&
              signal_acquire(W.consumed(ctx.peer(p), root_)) < stream_value(seq(), k - nslots_ + 1)) {
            waiting(p, "release of a broadcast slot");
            return progress;
          }
        }
      }
      const int64_t off = k * slot_bytes_;
      const int64_t len = std::min(slot_bytes_, nbytes_ - off);
      kernels::copy_bytes(region + (k % nslots_) * slot_bytes_, data + off, len);
      ctx.stats.add(ctx.stats.staged_bytes, len);
      kernels::store_fence();
      signal_release(W.produced(ctx.me, root_), stream_value(seq(), k + 1));
      progress = true;
    }
  } else {
    const char* region = W.staging(ctx.peer(root_));
    const uint64_t ready = signal_acquire(W.produced(ctx.peer(root_), root_));
    for (; next_chunk_ < nchunks_; ++next_chunk_) {
      const int64_t k = next_chunk_;
      if (ready < stream_value(seq(), k + 1)) {
        waiting(root_, "broadcast data");
        return progress;
      }
      const int64_t off = k * slot_bytes_;
      kernels::copy_bytes(data + off, region + (k % nslots_) * slot_bytes_,
                          std::min(slot_bytes_, nbytes_ - off));
      signal_release(W.consumed(ctx.me, root_), stream_value(seq(), k + 1));
      progress = true;
    }
  }
  mark_done();
  return true;
}

void BroadcastOp::finalize() {
  if (!buf_.is_same(user_)) user_.copy_(buf_);
  outputs_ = {user_};
}

}  // namespace cam
