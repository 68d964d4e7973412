#include "../../kernels/copy.hpp"
#include "collective.hpp"

namespace cam {
namespace {

// Bytes sender sends to its peers, from its descriptor's send sizes: whether they fit the
// eager area together decides, alike on every rank, whether its blocks go eager.
int64_t peer_send_bytes(const CollectiveWindow& W, const CollDesc* d, int sender, int n) {
  const int64_t* s = W.desc_send_bytes(d);
  int64_t total = 0;
  for (int j = 0; j < n; ++j) total += j == sender ? 0 : s[j];
  return total;
}

}  // namespace

AllToAllOp::AllToAllOp(const char* name, CollKind kind, uint64_t seq, Clock::time_point deadline, int dtype,
                       std::vector<AllToAllBlock> send, std::vector<AllToAllBlock> recv,
                       std::vector<at::Tensor> keep_alive,
                       std::vector<std::pair<at::Tensor, at::Tensor>> copy_back,
                       std::vector<at::Tensor> outputs)
    : CollectiveOp(name, kind, seq, deadline), dtype_(dtype),
      send_(std::move(send)), recv_(std::move(recv)), keep_alive_(std::move(keep_alive)),
      copy_back_(std::move(copy_back)), sent_(send_.size(), 0), received_(recv_.size(), 0) {
  outputs_ = std::move(outputs);
}

void AllToAllOp::fill_desc(Context& ctx, CollDesc* d) {
  d->dtype = dtype_;
  d->direct_min_bytes = ctx.heap.direct_read_available() ? ctx.cfg.single_copy_bytes : 0;
  // Heap-resident input: every block is published as an arena offset, read in place by peers.
  bool in_heap = true;
  for (int j = 0; j < ctx.world && in_heap; ++j) {
    in_heap = send_[j].nbytes == 0 || ctx.heap_offset(send_[j].ptr, send_[j].nbytes) >= 0;
  }
  d->heap_off = in_heap ? 0 : -1;
  int64_t* s = ctx.coll.desc_send_bytes(d);
  int64_t* r = ctx.coll.desc_recv_bytes(d);
  uint64_t* a = ctx.coll.desc_send_addr(d);
  for (int j = 0; j < ctx.world; ++j) {
    s[j] = send_[j].nbytes;
    r[j] = recv_[j].nbytes;
    a[j] = in_heap ? uint64_t(send_[j].nbytes > 0 ? ctx.heap_offset(send_[j].ptr, send_[j].nbytes) : 0)
                   : reinterpret_cast<uint64_t>(send_[j].ptr);
  }
  if (ctx.world > 1 && ctx.coll.eager_fits(peer_send_bytes(ctx.coll, d, ctx.rank, ctx.world))) {
    char* eager = ctx.coll.eager(ctx.me, seq());
    for (int j = 0; j < ctx.world; ++j) {
      if (j == ctx.rank) continue;
      kernels::copy_bytes(eager, send_[j].ptr, send_[j].nbytes);
      eager += send_[j].nbytes;
      ctx.stats.add(ctx.stats.staged_bytes, send_[j].nbytes);
    }
  }
}

void AllToAllOp::validate(Context& ctx, const std::vector<const CollDesc*>& descs) {
  auto who = [&](int r) { return r == ctx.rank ? std::string("this rank") : str("rank ", r); };
  for (int r = 0; r < ctx.world; ++r) {
    if (kind_ == CollKind::kAllGather && descs[r]->algo != 0) {
      refuse(ctx, uneven_all_gather_mismatch(r, true));
    }
  }
  for (int r = 0; r < ctx.world; ++r) {
    if (descs[r]->dtype != dtype_) {
      refuse(ctx, str(who(r), " exchanges ", dtype_name(descs[r]->dtype), " while this rank exchanges ",
                      dtype_name(dtype_)));
    }
  }
  for (int a = 0; a < ctx.world; ++a) {
    const int64_t* sends = ctx.coll.desc_send_bytes(descs[a]);
    for (int b = 0; b < ctx.world; ++b) {
      const int64_t* recvs = ctx.coll.desc_recv_bytes(descs[b]);
      if (sends[b] != recvs[a]) {
        refuse(ctx, str(who(a), " sends ", describe_bytes(sends[b], dtype_), " to ", who(b), " but ",
                        who(b), " expects ", describe_bytes(recvs[a], dtype_), " from ", who(a),
                        " (input split ", b, " on rank ", a, " must equal output split ", a,
                        " on rank ", b, ")"));
      }
    }
  }
  // Sizes agree: decide, identically on both ends, which blocks move by direct read. A
  // heap-resident sender's blocks are always read in place (plain loads); otherwise the
  // receiver's single-copy threshold rules (it is in the receiver's descriptor, seen by both).
  const int n = ctx.world, me = ctx.rank;
  std::vector<char> eager(n);
  for (int p = 0; p < n; ++p) eager[p] = ctx.coll.eager_fits(peer_send_bytes(ctx.coll, descs[p], p, n));
  auto direct = [&](int sender, int receiver, int64_t nbytes) -> char {
    if (eager[sender]) return kEager;
    if (descs[sender]->heap_off >= 0) return kDirectHeap;
    const int64_t min = descs[receiver]->direct_min_bytes;
    return min > 0 && nbytes >= min ? kDirectSyscall : kStaged;
  };
  direct_send_.assign(n, kStaged);
  direct_recv_.assign(n, kStaged);
  src_addr_.assign(n, 0);
  direct_done_.assign(n, 0);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    direct_send_[p] = direct(me, p, send_[p].nbytes);
    direct_recv_[p] = direct(p, me, recv_[p].nbytes);
    src_addr_[p] = ctx.coll.desc_send_addr(descs[p])[me];
    if (direct_recv_[p] == kEager) {  // p packed its blocks for ranks before this one first
      const int64_t* sends = ctx.coll.desc_send_bytes(descs[p]);
      src_addr_[p] = 0;
      for (int j = 0; j < me; ++j) src_addr_[p] += j == p ? 0 : sends[j];
    }
  }
}

bool AllToAllOp::data_step(Context& ctx) {
  const CollectiveWindow& W = ctx.coll;
  const int me = ctx.rank, n = ctx.world;
  if (nslots_ == 0) {
    region_bytes_ = W.staging_bytes() / n / 64 * 64;
    slot_bytes_ = std::min<int64_t>(ctx.cfg.chunk_bytes, region_bytes_ / 2) / 64 * 64;
    nslots_ = region_bytes_ / slot_bytes_;
    auto chunks = [&](int64_t bytes) { return (bytes + slot_bytes_ - 1) / slot_bytes_; };
    nsend_.assign(n, 0);
    nrecv_.assign(n, 0);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      nsend_[p] = direct_send_[p] == kEager ? 0 : direct_send_[p] ? 1 : chunks(send_[p].nbytes);
      nrecv_[p] = direct_recv_[p] ? 1 : chunks(recv_[p].nbytes);
    }
  }
  bool progress = false;
  if (!local_done_) {
    kernels::copy_bytes(recv_[me].ptr, send_[me].ptr, send_[me].nbytes);
    local_done_ = true;
    progress = true;
  }
  bool all_done = true;
  char* my_region = W.staging(ctx.me);
  // Peers are visited in a rotated order so that ranks do not all hit one peer at once.
  for (int d = 1; d < n; ++d) {
    const int dst = (me + d) % n;
    const int64_t nsend = nsend_[dst];
    if (direct_send_[dst] == kEager) {
      // Copied out of the eager area by dst; nothing to wait for.
    } else if (direct_send_[dst] && sent_[dst] == 0) {
      // dst reads the block itself; the op may finish only once it says it is done.
      if (signal_acquire(W.consumed(ctx.peer(dst), me)) >= stream_value(seq(), 1)) {
        sent_[dst] = 1;
        progress = true;
      } else {
        waiting(dst, "the direct read of this rank's all-to-all block");
      }
      all_done &= sent_[dst] == 1;
    } else if (sent_[dst] < nsend) {
      const uint64_t released = signal_acquire(W.consumed(ctx.peer(dst), me));
      char* ring = my_region + dst * region_bytes_;
      while (sent_[dst] < nsend) {
        const int64_t k = sent_[dst];
        if (k >= nslots_ && released < stream_value(seq(), k - nslots_ + 1)) {
          waiting(dst, "release of an all-to-all slot");
          break;
        }
        const int64_t off = k * slot_bytes_;
        const int64_t len = std::min(slot_bytes_, send_[dst].nbytes - off);
        kernels::copy_bytes(ring + (k % nslots_) * slot_bytes_, send_[dst].ptr + off, len);
        ctx.stats.add(ctx.stats.staged_bytes, len);
        kernels::store_fence();
        signal_release(W.produced(ctx.me, dst), stream_value(seq(), k + 1));
        ++sent_[dst];
        progress = true;
      }
      all_done &= sent_[dst] == nsend;
    }
    const int src = (me - d + n) % n;
    const int64_t nrecv = nrecv_[src];
    if (direct_recv_[src] == kEager && received_[src] == 0) {
      kernels::copy_bytes(recv_[src].ptr, W.eager(ctx.peer(src), seq()) + src_addr_[src], recv_[src].nbytes);
      received_[src] = 1;
      progress = true;
    } else if (direct_recv_[src] && received_[src] == 0) {
      // One piece per pass, so that staged channels and other readers keep flowing.
      const int64_t total = recv_[src].nbytes;
      const int64_t piece = std::min<int64_t>(kDirectPieceBytes, total - direct_done_[src]);
      if (direct_recv_[src] == kDirectHeap) {
        kernels::copy_bytes(recv_[src].ptr + direct_done_[src],
                            ctx.peer_heap(src, int64_t(src_addr_[src]) + direct_done_[src]), piece);
        ctx.stats.add(ctx.stats.heap_read_bytes, piece);
      } else {
        ctx.heap.read_peer(src, recv_[src].ptr + direct_done_[src], src_addr_[src] + direct_done_[src],
                           size_t(piece));
        ctx.stats.add(ctx.stats.direct_read_bytes, piece);
      }
      direct_done_[src] += piece;
      progress = true;
      if (direct_done_[src] == total) {
        signal_release(W.consumed(ctx.me, src), stream_value(seq(), 1));
        received_[src] = 1;
      }
      all_done &= received_[src] == 1;
    } else if (received_[src] < nrecv) {
      const uint64_t ready = signal_acquire(W.produced(ctx.peer(src), me));
      const char* ring = W.staging(ctx.peer(src)) + me * region_bytes_;
      while (received_[src] < nrecv) {
        const int64_t k = received_[src];
        if (ready < stream_value(seq(), k + 1)) {
          waiting(src, "all-to-all data");
          break;
        }
        const int64_t off = k * slot_bytes_;
        kernels::copy_bytes(recv_[src].ptr + off, ring + (k % nslots_) * slot_bytes_,
                            std::min(slot_bytes_, recv_[src].nbytes - off));
        signal_release(W.consumed(ctx.me, src), stream_value(seq(), k + 1));
        ++received_[src];
        progress = true;
      }
      all_done &= received_[src] == nrecv;
    }
  }
  if (all_done) mark_done();
  return progress;
}

void AllToAllOp::finalize() {
  for (auto& [dst, src] : copy_back_) dst.copy_(src);
}

}  // namespace cam
