#include "p2p.hpp"

#include <algorithm>
#include <cstring>

#include "../../kernels/copy.hpp"

namespace cam {
namespace {
int64_t padded(int64_t n) { return (n + 63) / 64 * 64; }
}  // namespace

SendOp::SendOp(Clock::time_point deadline, int dst_, int tag_, at::Tensor tensor)
    : Op("send", 0, deadline), dst(dst_), tag(tag_), dtype(int(tensor.scalar_type())),
      buf(tensor.contiguous()), nbytes(int64_t(tensor.nbytes())) {
  outputs_ = {std::move(tensor)};
}

SendOp::SendOp(Clock::time_point deadline, int dst_, int tag_, const std::string& reason)
    : Op("send", 0, deadline), dst(dst_), tag(tag_), dtype(kRefusalDtype),
      buf(at::empty({int64_t(reason.size())}, at::kByte)), nbytes(int64_t(reason.size())) {
  std::memcpy(buf.data_ptr(), reason.data(), reason.size());
}

RecvOp::RecvOp(uint64_t seq, Clock::time_point deadline, int src_, int tag_, std::string reason)
    : Op("recv", seq, deadline), src(src_), tag(tag_), dtype(kRefusalDtype), nbytes(-1),
      refusal(std::move(reason)) {}

RecvOp::RecvOp(uint64_t seq, Clock::time_point deadline, int src_, int tag_, at::Tensor tensor)
    : Op("recv", seq, deadline), src(src_), tag(tag_), dtype(int(tensor.scalar_type())),
      user(tensor), buf(tensor.is_contiguous() ? tensor : at::empty_like(tensor, at::MemoryFormat::Contiguous)),
      nbytes(int64_t(tensor.nbytes())) {}

void RecvOp::finalize() {
  if (!buf.is_same(user)) user.copy_(buf);
  outputs_ = {user};
}

P2PEngine::P2PEngine(int n)
    : world_(n), tx_queue_(n), tx_unacked_(n), tx_head_(n, 0), tx_msgs_(n, 0), rx_tail_(n, 0),
      rx_msgs_(n, 0), rx_cur_(n), unexpected_(n) {}

void P2PEngine::clear() {
  for (auto& q : tx_queue_) q.clear();
  for (auto& m : tx_unacked_) m.clear();
  for (auto& c : rx_cur_) c.reset();
  for (auto& q : unexpected_) q.clear();
  posted_.clear();
}

void P2PEngine::add_send(std::shared_ptr<SendOp> op) { tx_queue_[op->dst].push_back(std::move(op)); }

void P2PEngine::post_recv(Context& ctx, std::shared_ptr<RecvOp> r, Finished& finished) {
  // Earliest unmatched message with this tag, from the named source or from any source.
  for (int i = 0; i < world_; ++i) {
    const int s = r->src >= 0 ? r->src : (any_source_start_ + i) % world_;
    auto& q = unexpected_[s];
    for (auto it = q.begin(); it != q.end(); ++it) {
      if ((*it)->hdr.tag != r->tag) continue;
      auto rec = *it;
      q.erase(it);
      if (r->src < 0) any_source_start_ = (s + 1) % world_;
      bind(ctx, rec, r, finished);
      return;
    }
    if (r->src >= 0) break;
  }
  posted_.push_back(std::move(r));
}

std::shared_ptr<RecvOp> P2PEngine::match_posted(int src, int tag) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (((*it)->src == src || (*it)->src < 0) && (*it)->tag == tag) {
      auto r = *it;
      posted_.erase(it);
      return r;
    }
  }
  return nullptr;
}

bool P2PEngine::withdraw(const RecvOp& op) {
  auto it = std::find_if(posted_.begin(), posted_.end(), [&](const auto& r) { return r.get() == &op; });
  if (it == posted_.end()) return false;
  posted_.erase(it);
  return true;
}

bool P2PEngine::needs_drain(int src) const {
  for (const auto& r : posted_)
    if (r->src == src || r->src < 0) return true;
  return false;
}

void P2PEngine::fail_told(Context& ctx, Record& rec, Finished& finished) {
  std::string reason(rec.buffer.begin(), rec.buffer.end());
  rec.told->fail(std::make_exception_ptr(ValidationError(str(
      rec.told->where(ctx.rank), ": rank ", rec.src, " refused its arguments for the send (tag ", rec.hdr.tag,
      ") this recv matched: ", reason))));
  finished.push_back(rec.told);
  rec.told.reset();
  std::vector<char>().swap(rec.buffer);
}

void P2PEngine::read_in_place(Context& ctx, const Record& rec, void* dst) {
  kernels::copy_bytes(dst, ctx.peer_heap(rec.src, rec.hdr.heap_off), rec.hdr.nbytes);
  ctx.stats.add(ctx.stats.heap_read_bytes, rec.hdr.nbytes);
}

void P2PEngine::bind(Context& ctx, const std::shared_ptr<Record>& rec,
                     const std::shared_ptr<RecvOp>& r, Finished& finished) {
  AckSlot& a = ctx.p2p.ack(ctx.me, rec->src, rec->msg);
  if (r->refused()) {
    // Tell the sender why this rank's recv refused; the message is dropped.
    a.expected_nbytes = 0;
    a.expected_dtype = kRefusalDtype;
    a.status = kAckRefused;
    const size_t n = std::min(r->refusal.size(), kAckReasonBytes - 1);
    std::memcpy(a.reason, r->refusal.data(), n);
    a.reason[n] = 0;
    signal_release(a.seq, rec->msg + 1);
    r->matched(rec->src);
    rec->discard = true;
    rec->buffer.clear();
    r->fail(std::make_exception_ptr(ValidationError(r->refusal)));
    finished.push_back(r);
    return;
  }
  if (rec->hdr.dtype == kRefusalDtype) {
    // The sender refused its own arguments; its reason is the payload (always drained).
    a.status = kAckOk;
    signal_release(a.seq, rec->msg + 1);
    r->matched(rec->src);
    rec->told = r;
    if (rec->complete) fail_told(ctx, *rec, finished);
    return;
  }
  const bool ok = r->nbytes == rec->hdr.nbytes && r->dtype == rec->hdr.dtype;
  a.expected_nbytes = r->nbytes;
  a.expected_dtype = r->dtype;
  a.status = ok ? kAckOk : kAckSizeMismatch;
  r->matched(rec->src);
  if (!ok) {
    signal_release(a.seq, rec->msg + 1);
    rec->discard = true;
    rec->buffer.clear();
    r->fail(std::make_exception_ptr(ValidationError(str(
        r->where(ctx.rank), ": rank ", rec->src, " sent a message with tag ", rec->hdr.tag,
        " holding ", describe_bytes(rec->hdr.nbytes, rec->hdr.dtype), " but this recv expects ",
        describe_bytes(r->nbytes, r->dtype), "; the message was dropped"))));
    finished.push_back(r);
    return;
  }
  rec->bound = r;
  if (!rec->buffer.empty()) {
    kernels::copy_bytes(r->buf.data_ptr(), rec->buffer.data(),
                        std::min<int64_t>(rec->consumed, rec->hdr.nbytes));
    std::vector<char>().swap(rec->buffer);
  } else if (rec->hdr.heap_off >= 0) {
    read_in_place(ctx, *rec, r->buf.data_ptr());
  }
  // The ack comes after any in-place read: it lets the sender reuse its tensor.
  signal_release(a.seq, rec->msg + 1);
  if (rec->complete) {
    r->complete();
    finished.push_back(r);
  }
}

bool P2PEngine::progress(Context& ctx, Finished& finished) {
  bool progress = false;
  for (int p = 0; p < world_; ++p) {
    if (p == ctx.rank) continue;
    progress |= progress_acks(ctx, p, finished);
    progress |= progress_tx(ctx, p);
    progress |= progress_rx(ctx, p, finished);
  }
  for (auto& r : posted_) {
    r->await(r->src, r->src < 0 ? "a message (any source)" : "a matching message");
  }
  return progress;
}

bool P2PEngine::progress_acks(Context& ctx, int dst, Finished& finished) {
  auto& unacked = tx_unacked_[dst];
  bool progress = false;
  for (auto it = unacked.begin(); it != unacked.end();) {
    SendOp& s = *it->second;
    const AckSlot& a = ctx.p2p.ack(ctx.peer(dst), ctx.rank, s.seq());
    if (signal_acquire(a.seq) != s.seq() + 1) {
      s.waiting_on(dst);
      ++it;
      continue;
    }
    if (a.status == kAckOk || s.dtype == kRefusalDtype) {
      s.finish_ok();  // a refused send already raised on its caller
    } else if (a.status == kAckRefused) {
      s.fail(std::make_exception_ptr(ValidationError(str(
          s.where(ctx.rank), " to rank ", dst, " (tag ", s.tag, "): the matching recv on rank ", dst,
          " refused its arguments: ", std::string(a.reason, strnlen(a.reason, kAckReasonBytes)),
          "; the message was dropped"))));
    } else {
      s.fail(std::make_exception_ptr(ValidationError(str(
          s.where(ctx.rank), " to rank ", dst, " (tag ", s.tag, "): the message holds ",
          describe_bytes(s.nbytes, s.dtype), " but the matching recv on rank ", dst, " expects ",
          describe_bytes(a.expected_nbytes, a.expected_dtype), "; the message was dropped"))));
    }
    finished.push_back(it->second);
    it = unacked.erase(it);
    progress = true;
  }
  return progress;
}

bool P2PEngine::progress_tx(Context& ctx, int dst) {
  auto& q = tx_queue_[dst];
  if (q.empty()) return false;
  const P2PWindow& W = ctx.p2p;
  const int64_t R = W.ring_bytes();
  char* ring = W.ring(ctx.me, dst);
  uint64_t tail = signal_acquire(W.tail(ctx.peer(dst), ctx.rank));
  uint64_t& head = tx_head_[dst];
  const uint64_t head0 = head;
  while (!q.empty()) {
    SendOp& s = *q.front();
    if (s.written == 0) {
      const uint64_t msg = tx_msgs_[dst];
      // The ack slot of msg is free once msg - kAckSlots has been acknowledged.
      auto& unacked = tx_unacked_[dst];
      if (!unacked.empty() && unacked.begin()->first + kAckSlots <= msg) break;
      if (int64_t(R - (head - tail)) < int64_t(sizeof(MsgHeader))) {
        tail = signal_acquire(W.tail(ctx.peer(dst), ctx.rank));
        if (int64_t(R - (head - tail)) < int64_t(sizeof(MsgHeader))) break;
      }
      s.assign_index(msg);
      s.heap_off = s.dtype == kRefusalDtype ? -1 : ctx.heap_offset(s.buf.data_ptr(), s.nbytes);
      MsgHeader h{msg + 1, s.nbytes, s.tag, s.dtype, s.heap_off};
      kernels::ring_write(ring, R, head, reinterpret_cast<const char*>(&h), sizeof(h));
      head += sizeof(h);
      s.written = sizeof(h);
      ++tx_msgs_[dst];
    }
    const int64_t framed = s.framed_bytes();
    const char* data = static_cast<const char*>(s.buf.data_ptr());
    while (s.written < framed) {
      int64_t space = R - int64_t(head - tail);
      if (space == 0) {
        signal_release(W.head(ctx.me, dst), head);  // let the receiver start
        tail = signal_acquire(W.tail(ctx.peer(dst), ctx.rank));
        space = R - int64_t(head - tail);
        if (space == 0) break;
      }
      const int64_t n = std::min({space, framed - s.written, ctx.cfg.chunk_bytes});
      const int64_t payload_off = s.written - int64_t(sizeof(MsgHeader));
      const int64_t copy = std::clamp<int64_t>(s.nbytes - payload_off, 0, n);
      kernels::ring_write(ring, R, head, data + payload_off, copy);
      ctx.stats.add(ctx.stats.staged_bytes, copy);
      head += n;
      s.written += n;
    }
    if (s.written < framed) {
      s.waiting_on(dst);
      break;
    }
    tx_unacked_[dst].emplace_back(s.seq(), q.front());
    q.pop_front();
  }
  if (head != head0) {
    kernels::store_fence();
    signal_release(W.head(ctx.me, dst), head);
    return true;
  }
  return false;
}

bool P2PEngine::progress_rx(Context& ctx, int src, Finished& finished) {
  const P2PWindow& W = ctx.p2p;
  const int64_t R = W.ring_bytes();
  const char* ring = W.ring(ctx.peer(src), ctx.rank);
  uint64_t& tail = rx_tail_[src];
  const uint64_t tail0 = tail;
  uint64_t head = signal_acquire(W.head(ctx.peer(src), ctx.rank));
  bool progress = false;
  for (int messages = 0; messages < 64; ++messages) {
    auto& cur = rx_cur_[src];
    if (!cur) {
      if (head - tail < sizeof(MsgHeader)) break;
      auto rec = std::make_shared<Record>();
      kernels::ring_read(reinterpret_cast<char*>(&rec->hdr), ring, R, tail, sizeof(MsgHeader));
      if (rec->hdr.index_plus1 != rx_msgs_[src] + 1) {
        throw FatalError(str("cam recv on rank ", ctx.rank, ": message stream from rank ", src,
                             " is corrupt (expected message #", rx_msgs_[src] + 1, ", found #",
                             rec->hdr.index_plus1, ")"));
      }
      tail += sizeof(MsgHeader);
      ++rx_msgs_[src];
      rec->src = src;
      rec->msg = rec->hdr.index_plus1 - 1;
      cur = rec;
      progress = true;
      if (auto r = match_posted(src, rec->hdr.tag)) bind(ctx, rec, r, finished);
      else unexpected_[src].push_back(rec);
    }
    Record& rec = *cur;
    const bool in_place = rec.hdr.heap_off >= 0;
    const int64_t payload = in_place ? 0 : padded(rec.hdr.nbytes);
    if (in_place && !rec.bound && !rec.discard && rec.buffer.empty() && needs_drain(src)) {
      // A posted recv waits behind it: take the payload now, so that the ring moves on.
      rec.buffer.resize(size_t(rec.hdr.nbytes));
      read_in_place(ctx, rec, rec.buffer.data());
      rec.consumed = rec.hdr.nbytes;
    }
    // An unmatched message stays in the ring, unless a posted recv waits behind it or it is a
    // refusal (a reason of at most a few hundred bytes).
    if (rec.consumed < payload && !rec.bound && !rec.discard && !needs_drain(src) &&
        rec.hdr.dtype != kRefusalDtype)
      break;
    while (rec.consumed < payload) {
      int64_t avail = int64_t(head - tail);
      if (avail == 0) {
        signal_release(W.tail(ctx.me, src), tail);  // hand space back before re-polling
        head = signal_acquire(W.head(ctx.peer(src), ctx.rank));
        avail = int64_t(head - tail);
        if (avail == 0) break;
      }
      const int64_t n = std::min({avail, payload - rec.consumed, ctx.cfg.chunk_bytes});
      const int64_t copy = std::clamp<int64_t>(rec.hdr.nbytes - rec.consumed, 0, n);
      char* dst = nullptr;
      if (rec.bound) {
        dst = static_cast<char*>(rec.bound->buf.data_ptr()) + rec.consumed;
      } else if (!rec.discard) {
        if (rec.buffer.empty()) rec.buffer.resize(size_t(rec.hdr.nbytes));
        dst = rec.buffer.data() + rec.consumed;
      }
      if (dst) kernels::ring_read(dst, ring, R, tail, copy);
      tail += n;
      rec.consumed += n;
      progress = true;
    }
    if (rec.consumed < payload) break;
    rec.complete = true;
    if (rec.bound) {
      rec.bound->complete();
      finished.push_back(rec.bound);
    } else if (rec.told) {
      fail_told(ctx, rec, finished);
    }
    cur.reset();  // an unbound message stays queued in unexpected_[src], complete
  }
  if (tail != tail0) signal_release(W.tail(ctx.me, src), tail);
  return progress;
}

}  // namespace cam
